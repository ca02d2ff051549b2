//! Views of a table, one a concern (see `table_view!`): the helpers of
//! checkpoint writing, the disk tier, eviction, a step's phases, lookups,
//! pooling, the lookup memo and writes, off the [`Table`]'s facade.

table_view!(
    /// A table's checkpoint writing: gathering rows into files, the marks
    /// and logs of incremental saves, adoption of a disk table's files.
    Checkpointer
);

table_view!(
    /// A disk table's floor (`table::cold`): a plan standing on it, rows
    /// moved in before a call and out after it, compaction rounds.
    DiskTier
);

table_view!(
    /// Capacity and TTL eviction (`table::policy`) and the lowest-scoring
    /// rows kept for it (`table::lowest`).
    Evictor
);

table_view!(
    /// A step's phases: plans and reservations (`step::prepare`), the
    /// bounds and dry run (`step::bounds`), the update (`step::apply`).
    Stepper
);

table_view!(
    /// A lookup's shard passes: rows resolved, served and copied
    /// (`read::lookup`).
    Reader
);

table_view!(
    /// A pooled lookup's passes: the features' rows found, bags pooled
    /// (`read::pooled`, `read::pooling`).
    Pooler
);

table_view!(
    /// The memo a training lookup leaves for the step that follows it
    /// (`batch::found`).
    Memos
);

table_view!(
    /// Assigns on checked input (`table::write`) and stored rows decoded
    /// (`table::stored`).
    Writer
);
