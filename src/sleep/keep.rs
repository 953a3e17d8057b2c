//! A kept sleep: the device chunks move to host pieces with the data, and
//! back at the wake.

use super::{count_in, plan_groups, Asleep, Env, Host, SleepReport};
use crate::backend::Backend;
use crate::error::Result;
use crate::location::Location;

impl<B: Backend> Env<'_, B> {
    /// A kept sleep: device chunks to host pieces, with the data.
    pub(super) fn sleep_keep<H: Host<B>>(
        &self,
        host: &mut H,
        piece: usize,
        r: &mut SleepReport,
    ) -> Result<()> {
        let groups = plan_groups(
            &host.region().table,
            |_, e| e.placement != Location::Host,
            Location::Host,
            piece,
            host.zone_border(),
        );
        r.chunks_before = count_in(&host.region().table, &groups);
        r.migration = self.mover().run_groups(host.region_mut(), &groups)?;
        r.chunks_after = groups.len();
        r.bytes = r.migration.bytes_moved;
        host.set_placement(Location::Host);
        Ok(())
    }

    /// The wake of a kept sleep: the host pieces move back to the arena's
    /// placement, with the data.
    pub(super) fn wake_keep<H: Host<B>>(
        &self,
        host: &mut H,
        asleep: &Asleep<H::Fence>,
        r: &mut SleepReport,
    ) -> Result<()> {
        let groups = plan_groups(
            &host.region().table,
            |_, e| e.placement == Location::Host,
            self.home,
            asleep.piece,
            host.zone_border(),
        );
        r.chunks_before = count_in(&host.region().table, &groups);
        let m = self.mover().run_groups(host.region_mut(), &groups)?;
        r.migration = m;
        r.bytes = m.bytes_moved;
        r.chunks_after = groups.len();
        r.device_bytes = if self.home == Location::Host {
            0
        } else {
            m.bytes_moved
        };
        host.set_placement(self.home);
        Ok(())
    }
}
