//! A kept sleep: the device chunks move to host pieces with the data, and
//! back at the wake.

use super::*;

impl<B: Backend> Shared<B> {
    /// A kept sleep: device chunks to host pieces, with the data.
    pub(super) fn sleep_keep(
        &self,
        st: &mut State<B>,
        piece: usize,
        r: &mut SleepReport,
    ) -> Result<()> {
        let groups = plan_groups(
            &st.region.table,
            |_, e| e.placement != Location::Host,
            Location::Host,
            piece,
            st.heap.zone_border(),
        );
        r.chunks_before = count_in(&st.region.table, &groups);
        r.migration = self.mover().run_groups(&mut st.region, &groups)?;
        r.chunks_after = groups.len();
        r.bytes = r.migration.bytes_moved;
        st.placement = Location::Host;
        Ok(())
    }

    /// The wake of a kept sleep: the host pieces move back to the arena's
    /// placement, with the data.
    pub(super) fn wake_keep(
        &self,
        st: &mut State<B>,
        asleep: &Asleep<Mark<B::Fence>>,
        r: &mut SleepReport,
    ) -> Result<()> {
        let groups = plan_groups(
            &st.region.table,
            |_, e| e.placement == Location::Host,
            self.placement,
            asleep.piece,
            st.heap.zone_border(),
        );
        r.chunks_before = count_in(&st.region.table, &groups);
        let m = self.mover().run_groups(&mut st.region, &groups)?;
        r.migration = m;
        r.bytes = m.bytes_moved;
        r.chunks_after = groups.len();
        r.device_bytes = if self.placement == Location::Host {
            0
        } else {
            m.bytes_moved
        };
        st.placement = self.placement;
        Ok(())
    }
}
