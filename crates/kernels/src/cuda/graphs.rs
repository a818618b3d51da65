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
                self.grow(&mut st.xbf, rows * GRAPH_MAX_K * per_elem);
            }
            decode
        }; // the ops in `body` take the state lock themselves
        let mut g = graphs.lock().unwrap();
        if !decode || g.failed.contains(&key) {
            g.eager += 1;
            drop(g);
            return body();
        }
        let generation = ALLOC_GENERATION.load(std::sync::atomic::Ordering::SeqCst);
        if g.generation != generation {
            g.clear();
            g.generation = generation;
        }
        if let Some(&(_, exec)) = g.execs.iter().find(|e| e.0 == key) {
            // SAFETY: a live executable graph of this context; its buffers are unchanged
            // (same allocation generation).
            self.launch_graph(exec);
            g.replays += 1;
            return;
        }
        if g.execs.len() >= MAX_GRAPHS {
            g.eager += 1;
            return body();
        }
        g.recordings += 1;
        // Record. A failure leaves the step unexecuted: run it eagerly, and this shape always.
        let mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
        if unsafe { result::stream::begin_capture(self.stream, mode) }.is_err() {
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
        let exec = match exec {
            Ok(e) => e,
            Err(e) => {
                tracing::warn!("CUDA graph capture of a {rows}-row step failed on {} ({e:?}); that shape runs eagerly", self.name);
                g.failed.push(key);
                return body();
            }
        };
        self.launch_graph(exec);
        if ALLOC_GENERATION.load(std::sync::atomic::Ordering::SeqCst) != generation {
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
