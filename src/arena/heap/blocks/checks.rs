//! What tests reach the free-block index by: walls that never or always
//! stand, bounds that move the blocks between their forms early, and the
//! check of the index's invariants.

use super::*;

/// No walls: blocks join wherever they touch.
pub(crate) struct NoWalls;

impl Walls for NoWalls {
    #[inline]
    fn at(&self, _: usize) -> bool {
        false
    }
    #[inline]
    fn first_inside(&self, _: usize, _: usize) -> Option<usize> {
        None
    }
}

impl Walls for std::collections::BTreeSet<usize> {
    fn at(&self, offset: usize) -> bool {
        self.contains(&offset)
    }
    fn first_inside(&self, start: usize, end: usize) -> Option<usize> {
        (start < end)
            .then(|| self.range(start + 1..end).next().copied())
            .flatten()
    }
}

impl<F> Blocks<F> {
    /// Blocks that move between the forms at other counts (to test the
    /// moves).
    #[inline]
    pub(crate) fn with_bounds(join_settled: bool, to_many: usize, to_few: usize) -> Self {
        Self {
            to_many,
            to_few,
            ..Self::new(join_settled)
        }
    }

    /// Whether the blocks are in trees.
    #[inline]
    pub(crate) fn in_trees(&self) -> bool {
        matches!(self.form, Form::Many(_))
    }

    /// Checks the indexes agree and no blocks overlap or could have merged.
    #[inline]
    pub(crate) fn check(&self) -> Result<(), String> {
        self.check_in(&NoWalls)
    }

    /// [`check`](Self::check) with `walls`: blocks apart at a wall need not
    /// have merged, and a block that straddles one is pending and no
    /// stream's.
    pub(crate) fn check_in(&self, walls: &impl Walls) -> Result<(), String> {
        on_form!(self, b => b.check(walls))?;
        for (o, f) in self.iter() {
            if walls.first_inside(o, o + f.size).is_some() && (f.settled() || f.stream.is_some()) {
                return Err(format!(
                    "block at {o:#x} of {:#x} straddles a wall and may be taken",
                    f.size
                ));
            }
        }
        Ok(())
    }
}
