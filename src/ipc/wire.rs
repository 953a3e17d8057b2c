//! The wire format of a shared buffer's generations, as pure code: what the
//! exporter sends ([`describe`]) and what the importer accepts
//! ([`validate`]), tested without sockets. The format is documented on the
//! [module](super); the sockets are in `socket.rs`, the mapping in
//! `import.rs`.
#![deny(unsafe_code)]

use std::collections::BTreeMap;

use bytemuck::{Pod, Zeroable};

use crate::error::{Error, Result};
use crate::location::Location;

/// The most descriptors one message carries (the kernel's limit is 253).
pub const FDS_PER_MESSAGE: usize = 250;

/// The most chunk records one generation may carry (2^20: 2 TiB in 2 MiB
/// chunks, past the driver's ceiling of about 2^19 mappings a process). An
/// importer refuses a description with more, or with more than the
/// reservation has granules, before reading its records
/// ([`Error::Protocol`]); applying one is linear in its records.
pub const MAX_RECORDS: u64 = 1 << 20;

pub(crate) const MAGIC: u64 = u64::from_le_bytes(*b"vmmbufv1");
pub(crate) const KIND_DESC: u64 = 1;
pub(crate) const KIND_FDS: u64 = 2;
/// A record's last field: its chunk's descriptor follows in a batch.
pub(crate) const FRESH_FD: u64 = 1;
/// A record's last field: its chunk's fabric handle (64 bytes) follows the
/// description's records, in record order.
pub(crate) const FRESH_FABRIC: u64 = 2;
/// Placement code for host memory; a GPU is its ordinal.
const HOST: u64 = u64::MAX;

/// The fixed head of every message.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, Pod, Zeroable)]
pub(crate) struct Head {
    pub(crate) magic: u64,
    pub(crate) kind: u64,
    pub(crate) generation: u64,
    /// Description: the reservation's bytes. Descriptor batch: unused.
    pub(crate) reserved: u64,
    pub(crate) granularity: u64,
    pub(crate) len: u64,
    /// Description: chunk records that follow. Batch: record indices that
    /// follow, one per descriptor attached.
    pub(crate) count: u64,
    /// Description: how many descriptors the batches after it carry.
    pub(crate) fds: u64,
}

/// One chunk of a description.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub(crate) struct Record {
    pub(crate) offset: u64,
    pub(crate) bytes: u64,
    pub(crate) placement: u64,
    /// The exporter's [`Backend::chunk_id`].
    pub(crate) id: u64,
    /// 1 if this chunk's descriptor follows (new to this peer).
    pub(crate) fresh: u64,
}

pub(crate) fn placement_code(l: Location) -> u64 {
    match l {
        Location::Host => HOST,
        Location::Device(d) => d as u64,
    }
}

pub(crate) fn placement_of(code: u64) -> Result<Location> {
    match code {
        HOST => Ok(Location::Host),
        d if d <= u32::MAX as u64 => Ok(Location::Device(d as u32)),
        d => Err(Error::protocol(format!("placement code {d:#x}"))),
    }
}

/// One generation as the exporter describes it: the head, every chunk's
/// record, and which records' descriptors follow (indices into `records`).
#[derive(Debug)]
pub(crate) struct Description {
    pub(crate) head: Head,
    pub(crate) records: Vec<Record>,
    pub(crate) fresh_at: Vec<u64>,
}

/// One chunk the exporter holds: offset, bytes, placement and chunk id.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Chunk {
    pub(crate) offset: u64,
    pub(crate) bytes: u64,
    pub(crate) placement: Location,
    pub(crate) id: u64,
}

/// Describes generation `generation` of a buffer of `reserved` bytes at
/// `granularity`, `len` bytes in use, holding `chunks` (in address order),
/// for a peer that was sent `sent` (offset -> (bytes, id)) before: a chunk
/// is fresh (its handle, of `kind`, follows) unless that peer has had it.
pub(crate) fn describe(
    generation: u64,
    reserved: u64,
    granularity: u64,
    len: u64,
    chunks: impl IntoIterator<Item = Chunk>,
    sent: &BTreeMap<u64, (u64, u64)>,
    kind: crate::ipc::HandleKind,
) -> Description {
    let code = match kind {
        crate::ipc::HandleKind::PosixFd => FRESH_FD,
        crate::ipc::HandleKind::Fabric => FRESH_FABRIC,
    };
    let mut records = Vec::new();
    let mut fresh_at = Vec::new();
    for c in chunks {
        let fresh = sent.get(&c.offset) != Some(&(c.bytes, c.id));
        if fresh {
            fresh_at.push(records.len() as u64);
        }
        records.push(Record {
            offset: c.offset,
            bytes: c.bytes,
            placement: placement_code(c.placement),
            id: c.id,
            fresh: if fresh { code } else { 0 },
        });
    }
    let head = Head {
        magic: MAGIC,
        kind: KIND_DESC,
        generation,
        reserved,
        granularity,
        len,
        count: records.len() as u64,
        // Descriptors follow in batches; fabric handles inline.
        fds: if code == FRESH_FD {
            fresh_at.len() as u64
        } else {
            0
        },
    };
    Description {
        head,
        records,
        fresh_at,
    }
}

/// What the importer holds when a generation arrives.
#[derive(Debug)]
pub(crate) struct Held<'a> {
    pub(crate) generation: u64,
    pub(crate) reserved: usize,
    pub(crate) granularity: usize,
    /// The exporter's chunk id at each offset held.
    pub(crate) ids: &'a BTreeMap<usize, u64>,
}

/// A chunk to import: its record's index, where it goes, and what it is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Fresh {
    pub(crate) index: usize,
    pub(crate) offset: usize,
    pub(crate) bytes: usize,
    pub(crate) placement: Location,
    pub(crate) id: u64,
}

/// A generation checked against what is held: what to import, what stays,
/// what goes, and the new length. Applying it cannot fail for a reason
/// [`validate`] could have seen.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Plan {
    pub(crate) generation: u64,
    pub(crate) len: usize,
    pub(crate) fresh: Vec<Fresh>,
    /// Offsets held now that no record keeps: unmapped and released.
    pub(crate) gone: Vec<usize>,
}

/// Checks a generation (`head`, `records`) against `held`: a generation
/// past the one held, the same reservation, records in address order,
/// whole granules of their placement (`granularity_of`) within the
/// reservation, on a device this one can reach (`reachable`), a chunk not
/// sent again only where this importer holds it with the same id, and the
/// length within the chunks that run from offset 0 without a hole. Linear in
/// the records (up to a log factor). Nothing is changed: every check comes
/// before any effect.
pub(crate) fn validate(
    head: &Head,
    records: &[Record],
    held: &Held<'_>,
    granularity_of: impl Fn(Location) -> Result<usize>,
    reachable: impl Fn(Location) -> Result<bool>,
) -> Result<Plan> {
    check_head(head, held)?;
    let mut end = 0u64;
    // Where the run of chunks from offset 0 without a hole ends: the length
    // must lie within it (the chunk table's rule).
    let mut prefix = 0u64;
    let mut fresh = Vec::new();
    let mut kept = std::collections::BTreeSet::new();
    for (index, r) in records.iter().enumerate() {
        let place = check_record(head, r, end, &granularity_of, &reachable)?;
        end = r.offset + r.bytes;
        if r.offset == prefix {
            prefix = end;
        }
        let offset = r.offset as usize;
        if r.fresh == 0 {
            if held.ids.get(&offset) != Some(&r.id) {
                return Err(Error::protocol(format!(
                    "chunk {:#x} is not fresh, but this importer does not hold it",
                    r.offset
                )));
            }
            kept.insert(offset);
        } else {
            fresh.push(Fresh {
                index,
                offset,
                bytes: r.bytes as usize,
                placement: place,
                id: r.id,
            });
        }
    }
    if head.len > prefix {
        return Err(Error::protocol(format!(
            "length {} past {prefix}, where the chunks from offset 0 stop without a hole",
            head.len
        )));
    }
    let gone = held
        .ids
        .keys()
        .copied()
        .filter(|o| !kept.contains(o))
        .collect();
    Ok(Plan {
        generation: head.generation,
        len: head.len as usize,
        fresh,
        gone,
    })
}

/// A description must be newer than what is held, of the same reservation.
fn check_head(head: &Head, held: &Held<'_>) -> Result<()> {
    if head.generation <= held.generation {
        return Err(Error::StaleGeneration {
            got: head.generation,
            have: held.generation,
        });
    }
    if head.reserved as usize != held.reserved || head.granularity as usize != held.granularity {
        return Err(Error::protocol(format!(
            "the reservation changed: {} bytes at {} (held: {} at {})",
            head.reserved, head.granularity, held.reserved, held.granularity
        )));
    }
    Ok(())
}

/// One chunk's record: after the previous chunk's `end`, aligned to its
/// placement's granularity, inside the reservation, on a placement this
/// device reaches, with a known handle code. Its placement.
fn check_record(
    head: &Head,
    r: &Record,
    end: u64,
    granularity_of: &impl Fn(Location) -> Result<usize>,
    reachable: &impl Fn(Location) -> Result<bool>,
) -> Result<Location> {
    let place = placement_of(r.placement)?;
    let g = granularity_of(place)
        .map_err(|e| Error::protocol(format!("a chunk placed at {place}: {e}")))?
        as u64;
    let ok = r.offset >= end
        && r.bytes > 0
        && r.offset.is_multiple_of(g)
        && r.bytes.is_multiple_of(g)
        && r.offset
            .checked_add(r.bytes)
            .is_some_and(|e| e <= head.reserved);
    if !ok {
        return Err(Error::protocol(format!(
            "chunk {:#x}+{:#x} in a {:#x}-byte reservation",
            r.offset, r.bytes, head.reserved
        )));
    }
    if !reachable(place)? {
        return Err(Error::protocol(format!(
            "a chunk on {place}, which this device cannot reach"
        )));
    }
    if r.fresh > FRESH_FABRIC {
        return Err(Error::protocol(format!(
            "chunk {:#x}: unknown handle code {}",
            r.offset, r.fresh
        )));
    }
    Ok(place)
}

#[cfg(test)]
mod tests {
    use super::*;

    const G: u64 = 1 << 16;

    fn chunk(offset: u64, bytes: u64, id: u64) -> Chunk {
        Chunk {
            offset,
            bytes,
            placement: Location::Host,
            id,
        }
    }

    fn check(d: &Description, ids: &BTreeMap<usize, u64>, generation: u64) -> Result<Plan> {
        let held = Held {
            generation,
            reserved: (16 * G) as usize,
            granularity: G as usize,
            ids,
        };
        validate(&d.head, &d.records, &held, |_| Ok(G as usize), |_| Ok(true))
    }

    /// What the exporter describes, the importer accepts: fresh chunks the
    /// first time, none the second, and a released-then-recreated chunk
    /// (same offset, new id) fresh again.
    #[test]
    fn described_generations_validate_and_say_what_moves() {
        let mut sent = BTreeMap::new();
        let chunks = [chunk(0, G, 1), chunk(G, 2 * G, 2)];
        let d = describe(
            1,
            16 * G,
            G,
            3 * G,
            chunks,
            &sent,
            crate::ipc::HandleKind::PosixFd,
        );
        assert_eq!(
            (d.head.count, d.head.fds, d.fresh_at.clone()),
            (2, 2, vec![0, 1])
        );
        let plan = check(&d, &BTreeMap::new(), 0).unwrap();
        assert_eq!(
            (plan.generation, plan.len, plan.fresh.len()),
            (1, 3 * G as usize, 2)
        );
        assert!(plan.gone.is_empty());
        let mut ids: BTreeMap<usize, u64> = BTreeMap::new();
        for r in &d.records {
            sent.insert(r.offset, (r.bytes, r.id));
            ids.insert(r.offset as usize, r.id);
        }
        // The tail chunk released and a new one made at the same offset.
        let d2 = describe(
            2,
            16 * G,
            G,
            2 * G,
            [chunk(0, G, 1), chunk(G, G, 3)],
            &sent,
            crate::ipc::HandleKind::PosixFd,
        );
        assert_eq!(d2.fresh_at, vec![1]);
        let plan = check(&d2, &ids, 1).unwrap();
        assert_eq!(plan.gone, vec![G as usize], "the old chunk at G goes");
        assert_eq!(plan.fresh[0].id, 3);
    }

    /// RT-2: chunks that leave a hole below the length were accepted, and
    /// the failure came after the mappings had changed. Now refused here.
    #[test]
    fn a_hole_below_the_length_is_refused_before_any_effect() {
        let d = describe(
            1,
            16 * G,
            G,
            3 * G,
            [chunk(0, G, 1), chunk(2 * G, G, 2)],
            &BTreeMap::new(),
            crate::ipc::HandleKind::PosixFd,
        );
        let e = check(&d, &BTreeMap::new(), 0).unwrap_err();
        assert!(matches!(e, Error::Protocol { .. }), "{e}");
        // Up to the hole is fine.
        let mut d = d;
        d.head.len = G;
        assert!(check(&d, &BTreeMap::new(), 0).is_ok());
    }

    #[test]
    fn malformed_generations_are_typed_errors() {
        let none = BTreeMap::new();
        let good = || {
            describe(
                3,
                16 * G,
                G,
                G,
                [chunk(0, G, 1), chunk(G, G, 2)],
                &BTreeMap::new(),
                crate::ipc::HandleKind::PosixFd,
            )
        };
        assert!(matches!(
            check(&good(), &none, 3),
            Err(Error::StaleGeneration { got: 3, have: 3 })
        ));
        let mut d = good();
        d.head.reserved = 32 * G;
        assert!(
            matches!(check(&d, &none, 0), Err(Error::Protocol { .. })),
            "reservation changed"
        );
        let mut d = good();
        d.records.swap(0, 1);
        assert!(check(&d, &none, 0).is_err(), "out of order");
        let mut d = good();
        d.records[1].offset = G / 2;
        assert!(check(&d, &none, 0).is_err(), "overlapping and misaligned");
        let mut d = good();
        d.records[1].offset = 16 * G;
        assert!(check(&d, &none, 0).is_err(), "past the reservation");
        let mut d = good();
        d.records[0].fresh = 0;
        assert!(check(&d, &none, 0).is_err(), "not fresh, not held");
        let mut d = good();
        d.records[0].placement = 7;
        let held = Held {
            generation: 0,
            reserved: (16 * G) as usize,
            granularity: G as usize,
            ids: &none,
        };
        let e = validate(
            &d.head,
            &d.records,
            &held,
            |_| Ok(G as usize),
            |p| Ok(p == Location::Host),
        );
        assert!(
            matches!(e, Err(Error::Protocol { .. })),
            "a device out of reach"
        );
    }

    /// Fabric handles: the fresh records say so (code 2) and no descriptor
    /// is announced; a description mixing kinds validates (each record says
    /// its own); an unknown code is a typed error before any effect.
    #[test]
    fn fabric_records_are_told_apart_and_unknown_codes_refused() {
        let sent: BTreeMap<u64, (u64, u64)> = [(0, (G, 1))].into_iter().collect();
        let ids: BTreeMap<usize, u64> = [(0usize, 1u64)].into_iter().collect();
        let chunks = [chunk(0, G, 1), chunk(G, 2 * G, 2), chunk(3 * G, G, 3)];
        let d = describe(
            2,
            16 * G,
            G,
            4 * G,
            chunks,
            &sent,
            crate::ipc::HandleKind::Fabric,
        );
        assert_eq!(d.head.fds, 0, "no descriptor follows");
        assert_eq!(d.fresh_at, vec![1, 2]);
        let codes: Vec<u64> = d.records.iter().map(|r| r.fresh).collect();
        assert_eq!(codes, vec![0, FRESH_FABRIC, FRESH_FABRIC]);
        let plan = check(&d, &ids, 1).unwrap();
        assert_eq!(plan.fresh.len(), 2);
        let mut mixed = d;
        mixed.records[1].fresh = FRESH_FD;
        assert!(check(&mixed, &ids, 1).is_ok());
        mixed.records[2].fresh = 3;
        let e = check(&mixed, &ids, 1).unwrap_err();
        assert!(e.to_string().contains("unknown handle code 3"), "{e}");
    }
}
