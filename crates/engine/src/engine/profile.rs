//! Where the engine thread's time goes, step by step (`QUIVER_ENGINE_PROFILE=1`): the phases of
//! a step and the work between steps, averaged and printed to stderr every 256 steps. On a GPU the forward
//! only queues work and the draw waits for it, so `draw` is the device time the host did not
//! overlap and everything else is host time the device may have idled through. With overlapped
//! scheduling `draw` is mostly the wait for the previous step's draws (collected once this
//! step is queued), `emit` their acceptance, and the device runs through the other phases.

use std::time::Instant;

pub(super) const PHASES: [&str; 8] = ["messages", "schedule", "batch", "forward", "to_host", "rows", "draw", "emit"];

pub(super) struct StepProfile {
    last: Instant,
    /// The step being timed; added to `decode` or `mixed` when it ends.
    current: [f64; PHASES.len()],
    /// Steps of one token per row, and steps with prefill chunks: (phase totals, steps, rows).
    decode: ([f64; PHASES.len()], u64, u64),
    mixed: ([f64; PHASES.len()], u64, u64),
}

impl StepProfile {
    pub(super) fn from_env() -> Option<StepProfile> {
        std::env::var_os("QUIVER_ENGINE_PROFILE").filter(|v| v != "0").map(|_| StepProfile { last: Instant::now(), current: [0.0; PHASES.len()], decode: ([0.0; PHASES.len()], 0, 0), mixed: ([0.0; PHASES.len()], 0, 0) })
    }

    /// Idle time (waiting for a request) is no phase's.
    pub(super) fn skip(&mut self) {
        self.last = Instant::now();
    }

    /// The time since the previous mark goes to `phase`.
    pub(super) fn mark(&mut self, phase: usize) {
        let now = Instant::now();
        self.current[phase] += now.duration_since(self.last).as_secs_f64();
        self.last = now;
    }

    /// The step that ran `rows` sequences over `tokens` tokens is over (its `emit` phase ends at
    /// the next `messages` mark, so it is counted with the following step). `device_stats` (the
    /// device's own counters: graphs recorded and replayed, ...) is printed with each report.
    pub(super) fn end_step(&mut self, rows: usize, tokens: usize, device_stats: impl FnOnce() -> Option<String>) {
        let acc = if rows == tokens { &mut self.decode } else { &mut self.mixed };
        for (t, c) in acc.0.iter_mut().zip(&self.current) {
            *t += c;
        }
        acc.1 += 1;
        acc.2 += rows as u64;
        self.current = [0.0; PHASES.len()];
        if self.decode.1 + self.mixed.1 == 256 {
            for (what, acc) in [("decode", &mut self.decode), ("with prefill", &mut self.mixed)] {
                if acc.1 == 0 {
                    continue;
                }
                let per = |t: f64| t * 1e3 / acc.1 as f64;
                let total: f64 = acc.0.iter().sum();
                let parts: Vec<String> = PHASES.iter().zip(&acc.0).map(|(n, &t)| format!("{n} {:.3}", per(t))).collect();
                eprintln!("quiver: engine profile, {what} steps: {} of {:.1} rows, ms per step: {} (total {:.3})", acc.1, acc.2 as f64 / acc.1 as f64, parts.join(", "), per(total));
                *acc = ([0.0; PHASES.len()], 0, 0);
            }
            if let Some(s) = device_stats() {
                eprintln!("quiver: engine profile, device: {s}");
            }
        }
    }
}
