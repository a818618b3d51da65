//! Recorded decode steps (CUDA graphs), keyed by the batch shape.

use super::*;

/// Recorded decode steps (CUDA graphs), by batch shape.
#[derive(Default)]
pub(super) struct Graphs {
    pub(super) generation: u64,
    pub(super) execs: Vec<(u64, sys::CUgraphExec)>,
    /// Shapes whose recording failed: they run eagerly.
    pub(super) failed: Vec<u64>,
    /// Steps replayed, recorded, and run eagerly although a shape was given.
    pub(super) replays: u64,
    pub(super) recordings: u64,
    pub(super) eager: u64,
}

impl Graphs {
    pub(super) fn clear(&mut self) {
        for (_, e) in self.execs.drain(..) {
            // SAFETY: instantiated by us, destroyed once.
            let _ = unsafe { result::graph::exec_destroy(e) };
        }
    }
}

/// What a step does with its shape's recording.
#[derive(Clone, Copy)]
enum Plan {
    Eager,
    Replay(sys::CUgraphExec),
    Record,
}

impl Plan {
    /// The plan's kind, for the ranks of a group to compare.
    fn code(self) -> u64 {
        match self {
            Plan::Eager => 1,
            Plan::Replay(_) => 2,
            Plan::Record => 3,
        }
    }
}

/// Most shapes kept (a decode batch shape per running-sequence count, plus a few logits layouts);
/// past that, new shapes run eagerly.
const MAX_GRAPHS: usize = 320;

impl CudaDevice {
    /// Replays a recorded step on the compute stream.
    pub(super) fn launch_graph(&self, exec: sys::CUgraphExec) {
        // Writes device memory like any launch (and tells a collected draw that work followed it).
        self.touch();
        // SAFETY: callers pass a live executable graph of this context whose buffers are unchanged.
        unsafe { result::graph::launch(exec, self.stream) }.unwrap_or_else(|e| panic!("CUDA graph launch on {}: {e:?}", self.name));
    }

    /// Pure decode steps (one row per sequence, at most `graph_max_rows`) are recorded as a
    /// CUDA graph the first time their shape is seen and replayed after: one launch per step
    /// instead of ~10 per layer. Issuing launches bounds eager decode on the H200 VM (7.8 ms of
    /// host issue time per 8B step against microseconds of waiting); replay took batch-1 decode
    /// from 157 to 169 tok/s. Prefill steps run eagerly: their shapes rarely repeat.
    pub(super) fn run_step_recorded(&self, rows: usize, shape: Option<u64>, body: &mut dyn FnMut()) {
        let (Some(graphs), Some(key)) = (&self.graphs, shape) else { return body() };
        if rows == 0 || rows > self.graph_max_rows {
            return body();
        }
        self.bind();
        let decode = {
            let mut st = self.state.lock().unwrap();
            let decode = st.tiles.1 == rows; // otherwise some sequence brings several rows: prefill
            if decode && rows > GEMV_MAX_M {
                // Size the GEMM input scratch now: it may not grow while recording.
                let per_elem = if self.split_gemm == SplitGemm::Never { 2 } else { 4 };
                self.grow(&mut st.xbf, rows * (GRAPH_MAX_K + self.input_room.load(std::sync::atomic::Ordering::Relaxed)) * per_elem);
            }
            decode
        }; // the ops in `body` take the state lock themselves
        let mut g = graphs.lock().unwrap();
        // In a tensor-parallel group every decision below is the group's (collective.rs
        // `GroupAgree`): all ranks record, replay or run eagerly together. Outside one, `agreed`
        // is each rank's own view.
        let agree = self.tp_agree.get();
        // True on every rank when every rank's `ok` is (a unanimous false is a failure too).
        let agreed = |ok: bool| agree.map_or(ok, |a| a.agree(ok as u64) && ok);
        let generation = ALLOC_GENERATION.load(std::sync::atomic::Ordering::SeqCst);
        let plan = if !decode || g.failed.contains(&key) {
            Plan::Eager
        } else {
            if g.generation != generation {
                g.clear();
                g.generation = generation;
            }
            match g.execs.iter().find(|e| e.0 == key) {
                Some(&(_, exec)) => Plan::Replay(exec),
                None if g.execs.len() >= MAX_GRAPHS => Plan::Eager,
                None => Plan::Record,
            }
        };
        if let Some(a) = agree {
            if !a.agree(plan.code()) {
                // The ranks disagree (one lost its recordings to an allocation, or is full): this
                // step runs eagerly on every rank, and no rank keeps this shape's recording, so
                // the next step of the shape records it again on all of them.
                if let Some(i) = g.execs.iter().position(|e| e.0 == key) {
                    // SAFETY: instantiated by us, destroyed once.
                    let _ = unsafe { result::graph::exec_destroy(g.execs.remove(i).1) };
                }
                g.eager += 1;
                drop(g);
                return body();
            }
        }
        match plan {
            Plan::Eager => {
                g.eager += 1;
                drop(g);
                return body();
            }
            Plan::Replay(exec) => {
                // SAFETY: a live executable graph of this context; its buffers are unchanged
                // (same allocation generation).
                self.launch_graph(exec);
                g.replays += 1;
                return;
            }
            Plan::Record => {}
        }
        g.recordings += 1;
        // Record. A failure leaves the step unexecuted: run it eagerly, and this shape always.
        let mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
        let began = unsafe { result::stream::begin_capture(self.stream, mode) }.is_ok();
        if !agreed(began) {
            if began {
                if let Ok(graph) = unsafe { result::stream::end_capture(self.stream) } {
                    let _ = unsafe { result::graph::destroy(graph) };
                }
            }
            g.failed.push(key);
            return body();
        }
        self.recording.store(true, std::sync::atomic::Ordering::Relaxed);
        body();
        self.recording.store(false, std::sync::atomic::Ordering::Relaxed);
        let exec = unsafe { result::stream::end_capture(self.stream) }.and_then(|graph| {
            let exec = unsafe { result::graph::instantiate(graph, sys::CUgraphInstantiate_flags(0)) };
            let _ = unsafe { result::graph::destroy(graph) };
            exec
        });
        if let Err(e) = &exec {
            tracing::warn!("CUDA graph capture of a {rows}-row step failed on {} ({e:?}); that shape runs eagerly", self.name);
        }
        if !agreed(exec.is_ok()) {
            if let Ok(e) = exec {
                // Another rank failed: nobody replays it.
                let _ = unsafe { result::graph::exec_destroy(e) };
            }
            g.failed.push(key);
            return body();
        }
        let exec = exec.expect("agreed to be recorded");
        self.launch_graph(exec);
        if !agreed(ALLOC_GENERATION.load(std::sync::atomic::Ordering::SeqCst) == generation) {
            // Something was allocated while recording (its address is baked in but may move):
            // use this recording once only.
            self.synchronize().unwrap_or_else(|e| panic!("{e:#}"));
            let _ = unsafe { result::graph::exec_destroy(exec) };
        } else {
            g.execs.push((key, exec));
        }
    }
}

impl CudaDevice {
    /// `recorded / replayed / eager` steps and failed shapes so far, for benchmark reports.
    pub(super) fn graph_stats(&self) -> String {
        match &self.graphs {
            Some(g) => {
                let g = g.lock().unwrap();
                format!("CUDA graphs: {} steps recorded, {} replayed, {} eager; {} shapes failed to record", g.recordings, g.replays, g.eager, g.failed.len())
            }
            None => "CUDA graphs: off".into(),
        }
    }
}
