//! The hand-off of a round of moving rows out of memory between the call
//! that went over the bound (it schedules the round), the tier's thread
//! (it runs the round), the next call on the table (it runs a round the
//! thread has not begun, so that it never starts over the bound) and
//! `stats()` (it waits for a round in flight, so that its figures are
//! settled). Whoever runs a round holds the cold gate exclusively, and
//! clears `due` under it, so a round runs once; `running` is raised before
//! `due` is cleared, so a reader of both never sees neither while a round
//! is on its way.
//!
//! The flags are written over one atomics module (std's for the table,
//! loom's in this module's model: `cargo test -p embstore-core --features
//! loom --lib -- seqlock handoff`, which runs every interleaving of the
//! four parties with the gate).

macro_rules! handoff {
    ($atomic:path) => {
        use $atomic::{AtomicBool, Ordering::SeqCst};

        /// A disk table's round of moving rows out: scheduled, running.
        #[derive(Debug)]
        pub(crate) struct Handoff {
            due: AtomicBool,
            running: AtomicBool,
        }

        impl Handoff {
            pub(crate) fn new() -> Handoff {
                Handoff {
                    due: AtomicBool::new(false),
                    running: AtomicBool::new(false),
                }
            }

            /// Marks a round due; `true` where this call marked it (it
            /// starts the tier's thread), `false` where one was due.
            pub(crate) fn schedule(&self) -> bool {
                !self.due.swap(true, SeqCst)
            }

            /// Whether a round is due (a call's floor then tries the gate).
            pub(crate) fn due(&self) -> bool {
                self.due.load(SeqCst)
            }

            /// Whether a round is due or running (`stats()` then waits for
            /// the gate).
            pub(crate) fn in_flight(&self) -> bool {
                self.due.load(SeqCst) || self.running.load(SeqCst)
            }

            /// Calls a scheduled round off (the table is dropped).
            pub(crate) fn call_off(&self) {
                self.due.store(false, SeqCst);
            }

            /// With the cold gate held exclusively: runs `round` if one is
            /// due, clearing it (so that it runs once); whether it ran.
            pub(crate) fn run_if_due(&self, round: impl FnOnce()) -> bool {
                self.running.store(true, SeqCst);
                let due = self.due.swap(false, SeqCst);
                if due {
                    round();
                }
                self.running.store(false, SeqCst);
                due
            }
        }
    };
}

handoff!(std::sync::atomic);

#[cfg(all(test, feature = "loom"))]
mod loom_model {
    //! The hand-off under loom: a round scheduled, then the tier's thread,
    //! the next call and `stats()` racing for it around the gate; every
    //! interleaving checked: the round runs once, and neither the call
    //! (once on the floor) nor `stats()` (once settled) sees it undone.
    mod p {
        handoff!(loom::sync::atomic);
    }
    use loom::sync::atomic::{AtomicUsize, Ordering};
    use loom::sync::{Arc, RwLock};

    /// The tier's thread.
    fn tier(g: &RwLock<()>, h: &p::Handoff, r: &AtomicUsize) {
        if h.due() {
            let _x = g.write().unwrap();
            h.run_if_due(|| round(r));
        }
    }

    /// The next call: once on the floor, the round has run.
    fn call(g: &RwLock<()>, h: &p::Handoff, r: &AtomicUsize) {
        if h.due()
            && let Ok(x) = g.try_write()
        {
            h.run_if_due(|| round(r));
            drop(x);
        }
        let _on_the_floor = g.read().unwrap();
        assert_eq!(r.load(Ordering::SeqCst), 1, "a call started over the bound");
    }

    /// `stats()`: once settled, the round has run.
    fn stats(g: &RwLock<()>, h: &p::Handoff, r: &AtomicUsize) {
        if h.in_flight() {
            let _x = g.write().unwrap();
            h.run_if_due(|| round(r));
        }
        assert_eq!(r.load(Ordering::SeqCst), 1, "stats saw a round in flight");
    }

    fn round(r: &AtomicUsize) {
        r.fetch_add(1, Ordering::SeqCst);
    }

    type Party = fn(&RwLock<()>, &p::Handoff, &AtomicUsize);

    /// A round scheduled, then `parties` racing for it; the round ran once.
    fn race(parties: &'static [Party]) {
        let mut b = loom::model::Builder::new();
        b.preemption_bound = Some(3);
        b.check(move || {
            let gate = Arc::new(RwLock::new(()));
            let h = Arc::new(p::Handoff::new());
            let rounds = Arc::new(AtomicUsize::new(0));
            // The call over the bound, before the others.
            assert!(h.schedule());
            assert!(!h.schedule(), "scheduled once");
            let threads: Vec<_> = parties
                .iter()
                .map(|&party| {
                    let (g, hh, r) = (gate.clone(), h.clone(), rounds.clone());
                    loom::thread::spawn(move || party(&g, &hh, &r))
                })
                .collect();
            for t in threads {
                t.join().unwrap();
            }
            assert_eq!(rounds.load(Ordering::SeqCst), 1);
            assert!(!h.in_flight());
        });
    }

    #[test]
    fn handoff_the_tier_and_the_next_call_run_a_round_once_before_the_call() {
        race(&[tier, call]);
    }

    #[test]
    fn handoff_the_tier_and_stats_run_a_round_once_before_stats_returns() {
        race(&[tier, stats]);
    }

    #[test]
    fn handoff_the_next_call_and_stats_without_the_tier() {
        race(&[call, stats]);
    }
}
