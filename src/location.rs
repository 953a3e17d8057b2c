//! Where memory lives and who may touch it.

use std::fmt;

/// A memory location: a GPU by ordinal, or the host.
///
/// As a chunk's *placement* it says where the physical memory lives; in an
/// [`AccessDesc`] it names who is granted access.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Location {
    /// GPU memory of the device with this ordinal.
    Device(u32),
    /// Host memory (pinned host memory for the CUDA backend; the process's
    /// own memory for the host backend).
    Host,
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Location::Device(d) => write!(f, "gpu{d}"),
            Location::Host => f.write_str("host"),
        }
    }
}

/// Access rights of one location to a mapped range.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Access {
    /// No access: any touch faults.
    None,
    /// Read only: writes fault (on CUDA, copies into it return an error).
    Read,
    /// Read and write.
    #[default]
    ReadWrite,
}

impl fmt::Display for Access {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Access::None => "none",
            Access::Read => "r",
            Access::ReadWrite => "rw",
        })
    }
}

/// One entry of an access list: `location` gets `access`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct AccessDesc {
    /// Who is granted access.
    pub location: Location,
    /// What they may do.
    pub access: Access,
}

impl AccessDesc {
    /// `location` gets `access`.
    pub const fn new(location: Location, access: Access) -> Self {
        Self { location, access }
    }
}
