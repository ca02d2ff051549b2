//! A shard's disk files compacted: the work taken out of the shard (the
//! live rows of files at least half dead), and its result installed.

use super::*;

impl ColdShard {
    /// Takes the work of compacting this shard's files (other than the
    /// active segment) that are at least half dead and not being compacted
    /// already, the deadest first, about `budget` live rows of them (at
    /// least one file): their live rows, by file and record, and a number
    /// and path for the segment they go to. `None` when no file needs it.
    /// The job runs without the shard's lock ([`Job::run`]); its rows are
    /// named in their new place by [`ColdShard::install`].
    pub(crate) fn take_job(&mut self, budget: usize) -> Option<Job> {
        if !self.owned() {
            return None;
        }
        // A closed file with nothing live (a segment closed by
        // [`ColdShard::roll_over`] or half dead, whose last rows went before
        // it was closed) goes now: no job is needed to empty it.
        for n in 0..self.segments.len() {
            let empty = self.segments[n]
                .as_ref()
                .is_some_and(|s| s.live == 0 && !s.compacting);
            if empty
                && Some(n as u32) != self.active
                && let Some(s) = self.segments[n].take()
            {
                self.delete(&s.path);
            }
        }
        let mut found: Vec<(u32, u32, u32)> = self
            .segments
            .iter()
            .enumerate()
            .filter_map(|(n, s)| {
                let s = s.as_ref()?;
                let half = s.live * 2 <= s.written;
                let ok = Some(n as u32) != self.active && half && !s.compacting;
                ok.then_some((n as u32, s.live, s.written))
            })
            .collect();
        // The deadest first: a job's lists take memory by its live rows.
        found.sort_unstable_by_key(|&(_, live, written)| {
            u64::from(live) * 1_000_000 / u64::from(written.max(1))
        });
        let mut taken = 0usize;
        let victims: Vec<u32> = found
            .into_iter()
            .take_while(|&(_, live, _)| {
                let first = taken == 0;
                taken += live as usize;
                first || taken <= budget
            })
            .map(|v| v.0)
            .collect();
        if victims.is_empty() {
            return None;
        }
        self.write_failed = false;
        let mut live: HashMap<u32, Vec<(u32, i64, Loc)>> =
            victims.iter().map(|&v| (v, Vec::new())).collect();
        for (&key, &loc) in &self.index {
            if let Some(v) = live.get_mut(&loc.seg) {
                v.push((loc.rec, key, loc));
            }
        }
        let mut files = Vec::with_capacity(victims.len());
        for v in victims {
            let s = self.segments[v as usize].as_mut().expect("a victim");
            s.compacting = true;
            let mut rows = live.remove(&v).unwrap_or_default();
            rows.sort_unstable_by_key(|r| r.0);
            files.push((v, s.file.clone(), rows));
        }
        // The new segment's number, its slot empty until it is installed.
        let seg = self.segments.len() as u32;
        self.segments.push(None);
        Some(Job::new(seg, self.segment_path(seg), self.words, files))
    }

    /// Names the rows a compaction job moved in their new place (those
    /// that are still where the job found them: a row taken into memory,
    /// removed or moved to disk again meanwhile stays as it is); returns
    /// how many. A failed job's file is removed and its files may be
    /// compacted again.
    pub(crate) fn install_job(&mut self, done: Done) -> usize {
        for &v in &done.victims {
            if let Some(s) = self.segments[v as usize].as_mut() {
                s.compacting = false;
            }
        }
        let Some((file, moved, bytes)) = done.written else {
            self.delete(&self.segment_path(done.seg));
            return 0;
        };
        self.segments[done.seg as usize] = Some(Segment {
            file: Arc::new(file),
            path: self.segment_path(done.seg),
            bytes,
            written: moved.len() as u32,
            live: 0,
            compacting: false,
        });
        let mut n = 0;
        for (rec, key, old) in moved {
            if self.index.get(&key) == Some(&old) {
                let loc = Loc {
                    seg: done.seg,
                    rec,
                    generation: old.generation,
                    crc: 0,
                };
                self.set(key, loc);
                n += 1;
            }
        }
        let path = self.segment_path(done.seg);
        let slot = &mut self.segments[done.seg as usize];
        if slot.as_ref().is_some_and(|s| s.live == 0) {
            *slot = None;
            self.delete(&path);
        }
        n
    }

    /// Files other than the active segment that are at least half dead
    /// (none right after [`ColdShard::compact`]).
    #[cfg(test)]
    pub(crate) fn half_dead_files(&self) -> usize {
        let active = self.active;
        self.segments
            .iter()
            .enumerate()
            .filter_map(|(n, s)| Some((n, s.as_ref()?)))
            .filter(|(n, s)| Some(*n as u32) != active && s.live * 2 <= s.written)
            .count()
    }

    /// Dead records' share of the files.
    pub(crate) fn dead_share(&self) -> f64 {
        let (written, live) = self
            .segments
            .iter()
            .flatten()
            .fold((0u64, 0u64), |(w, l), s| {
                (w + u64::from(s.written), l + u64::from(s.live))
            });
        if written == 0 {
            0.0
        } else {
            1.0 - live as f64 / written as f64
        }
    }

    /// Compacts now (a job run and installed at once). Returns the rows
    /// moved.
    ///
    /// # Errors
    /// As [`Job::run`]: nothing moved.
    #[cfg(test)]
    pub(crate) fn compact(&mut self) -> Result<usize> {
        self.flush()?;
        let Some(job) = self.take_job(usize::MAX) else {
            return Ok(0);
        };
        let done = job.run();
        let err = done.error.clone();
        let n = self.install_job(done);
        match err {
            Some(e) => Err(ckpt_err("disk store", e)),
            None => Ok(n),
        }
    }
}
