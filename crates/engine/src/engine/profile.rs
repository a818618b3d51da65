//! Where the engine thread's time goes, step by step (`QUIVER_ENGINE_PROFILE=1`): the phases of
//! a step and the work between steps, averaged and logged every 256 steps. On a GPU the forward
//! only queues work and the draw waits for it, so `draw` is the device time the host did not
//! overlap and everything else is host time the device may have idled through.

use std::time::Instant;

pub(super) const PHASES: [&str; 8] = ["messages", "schedule", "batch", "forward", "to_host", "rows", "draw", "emit"];

pub(super) struct StepProfile {
    last: Instant,
    totals: [f64; PHASES.len()],
    steps: u64,
    rows: u64,
}

impl StepProfile {
    pub(super) fn from_env() -> Option<StepProfile> {
        std::env::var_os("QUIVER_ENGINE_PROFILE").filter(|v| v != "0").map(|_| StepProfile { last: Instant::now(), totals: [0.0; PHASES.len()], steps: 0, rows: 0 })
    }

    /// Idle time (waiting for a request) is no phase's.
    pub(super) fn skip(&mut self) {
        self.last = Instant::now();
    }

    /// The time since the previous mark goes to `phase`.
    pub(super) fn mark(&mut self, phase: usize) {
        let now = Instant::now();
        self.totals[phase] += now.duration_since(self.last).as_secs_f64();
        self.last = now;
    }

    pub(super) fn end_step(&mut self, rows: usize) {
        self.steps += 1;
        self.rows += rows as u64;
        if self.steps == 256 {
            let per = |t: f64| t * 1e3 / self.steps as f64;
            let total: f64 = self.totals.iter().sum();
            let parts: Vec<String> = PHASES.iter().zip(&self.totals).map(|(n, &t)| format!("{n} {:.3}", per(t))).collect();
            tracing::info!("engine profile, ms per step over {} steps of {:.1} rows: {} (total {:.3})", self.steps, self.rows as f64 / self.steps as f64, parts.join(", "), per(total));
            self.totals = [0.0; PHASES.len()];
            self.steps = 0;
            self.rows = 0;
        }
    }
}
