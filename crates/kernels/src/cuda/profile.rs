//! Optional per-op GPU timing (`QUIVER_CUDA_PROFILE=1`).

use super::*;

/// Optional per-op GPU timing (`QUIVER_CUDA_PROFILE=1`): an event is recorded on the stream
/// after every op; at each host sync the intervals between consecutive events are charged to
/// the op that ended them (launch gaps included, which is the point), and the totals are printed
/// when the device is dropped. Off, it costs one branch per op.
#[derive(Default)]
pub(super) struct Profiler {
    pub(super) pool: Vec<sys::CUevent>,
    pub(super) used: Vec<&'static str>,
    pub(super) totals: Vec<(&'static str, f64, u64)>,
    /// Host time from the step's staging to its final copy being queued (issuing work), and
    /// host time then spent waiting for the GPU: issue ≫ wait means the host is the bottleneck.
    pub(super) step_start: Option<std::time::Instant>,
    pub(super) issue_s: f64,
    pub(super) wait_s: f64,
    pub(super) steps: u64,
}

impl CudaDevice {
    /// Profiling: marks the end of op `what` on the stream.
    pub(super) fn mark(&self, what: &'static str) {
        let Some(p) = &self.profiler else { return };
        let mut p = p.lock().unwrap();
        let i = p.used.len();
        if i == p.pool.len() {
            match result::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT) {
                Ok(e) => p.pool.push(e),
                Err(_) => return,
            }
        }
        if unsafe { result::event::record(p.pool[i], self.stream) }.is_ok() {
            p.used.push(what);
        }
    }

    /// Profiling: after a host sync, charges the recorded intervals to their ops.
    pub(super) fn collect_profile(&self) {
        let Some(p) = &self.profiler else { return };
        let mut p = p.lock().unwrap();
        let Profiler { pool, used, totals, .. } = &mut *p;
        for i in 1..used.len() {
            let ms = unsafe { result::event::elapsed(pool[i - 1], pool[i]) }.unwrap_or(0.0) as f64;
            match totals.iter_mut().find(|t| t.0 == used[i]) {
                Some(t) => {
                    t.1 += ms;
                    t.2 += 1;
                }
                None => totals.push((used[i], ms, 1)),
            }
        }
        used.clear();
    }

}
