//! A call's hold of the floor of one or more disk tables
//! ([`Table::plan`](crate::table::Table::plan)), and what its release
//! does: rows over the memory bound are scheduled to move to disk.

use crate::table::views::DiskTier;
use std::sync::RwLockReadGuard;

use crate::table::Table;

/// A call's hold of the floors of one or more disk tables (the cold gate
/// of each, shared: [`Table::plan`]). On release it gives back every gate
/// first and then, where memory holds too many rows, schedules their move
/// to disk on the tier's thread, table by table
/// ([`DiskTier::spill_soon`]).
pub(crate) struct ColdHold<'a> {
    held: Vec<(&'a Table, RwLockReadGuard<'a, ()>)>,
}

impl<'a> ColdHold<'a> {
    /// The hold of `t`'s floor by `guard`, its cold gate taken shared.
    pub(crate) fn of(t: &'a Table, guard: RwLockReadGuard<'a, ()>) -> ColdHold<'a> {
        ColdHold {
            held: vec![(t, guard)],
        }
    }

    /// A hold of no table, for a call on several to gather theirs into
    /// ([`ColdHold::join`]) in the crate's order, ascending table id.
    pub(crate) fn none() -> ColdHold<'a> {
        ColdHold { held: Vec::new() }
    }

    /// Takes over `other`'s gates: they are released with this hold's.
    pub(crate) fn join(&mut self, other: Option<ColdHold<'a>>) {
        if let Some(mut o) = other {
            self.held.append(&mut o.held);
        }
    }

    /// `None` for a hold of no table.
    pub(crate) fn some(self) -> Option<ColdHold<'a>> {
        (!self.held.is_empty()).then_some(self)
    }
}

impl Drop for ColdHold<'_> {
    fn drop(&mut self) {
        let tables: Vec<&Table> = self.held.iter().map(|(t, _)| *t).collect();
        self.held.clear();
        for t in tables {
            DiskTier(t).spill_soon();
        }
    }
}
