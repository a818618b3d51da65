//! The threads of a tensor-parallel group: one persistent thread per rank 1.., woken for every
//! step (no spawn, no allocation per step), while rank 0 runs on the caller's thread. A step is
//! a closure called once per rank with the rank's index; `run` returns when every rank's call
//! has, so the closure may borrow the caller's data like a scoped thread.

use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

/// A step's closure with its lifetime erased; valid while [`RankThreads::run`] waits for it.
#[derive(Clone, Copy)]
struct Job(*const (dyn Fn(usize) + Sync + 'static));
// SAFETY: the closure is `Sync` and outlives every call made through the pointer (`run` waits
// until all ranks have returned before its borrow ends).
unsafe impl Send for Job {}

struct State {
    job: Option<Job>,
    generation: u64,
    /// Ranks 1.. still running the current job.
    pending: usize,
    /// The first failure of a rank ≥ 1 in the current job.
    failure: Option<(usize, String)>,
    shutdown: bool,
}

struct Shared {
    state: Mutex<State>,
    start: Condvar,
    done: Condvar,
    /// Called when a rank fails, before the others are waited for: makes their collectives
    /// fail instead of waiting for the failed rank.
    abort: Box<dyn Fn() + Send + Sync>,
}

pub struct RankThreads {
    ranks: usize,
    shared: Arc<Shared>,
    handles: Vec<JoinHandle<()>>,
}

fn message(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<String>().cloned().or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string())).unwrap_or_else(|| "panic".into())
}

impl RankThreads {
    /// Threads for ranks `1..ranks`; `abort` is called when any rank's call panics.
    pub fn new(ranks: usize, abort: Box<dyn Fn() + Send + Sync>) -> RankThreads {
        let shared = Arc::new(Shared {
            state: Mutex::new(State { job: None, generation: 0, pending: 0, failure: None, shutdown: false }),
            start: Condvar::new(),
            done: Condvar::new(),
            abort,
        });
        let handles = (1..ranks)
            .map(|r| {
                let sh = shared.clone();
                std::thread::Builder::new().name(format!("quiver-tp-rank-{r}")).spawn(move || rank_loop(&sh, r)).expect("spawn a tensor-parallel rank thread")
            })
            .collect();
        RankThreads { ranks, shared, handles }
    }

    /// Calls `f(r)` for every rank at once, `f(0)` on this thread, and returns when all have
    /// returned. A panic of any rank aborts the group and is raised here.
    pub fn run(&self, f: &(dyn Fn(usize) + Sync)) {
        let sh = &*self.shared;
        // SAFETY: only the lifetime is erased; this function does not return (nor unwind)
        // before every rank thread has finished with the pointer (`pending` reaches 0).
        let job = Job(unsafe { std::mem::transmute::<*const (dyn Fn(usize) + Sync + '_), *const (dyn Fn(usize) + Sync + 'static)>(f) });
        {
            let mut s = sh.state.lock().unwrap_or_else(|p| p.into_inner());
            s.job = Some(job);
            s.generation += 1;
            s.pending = self.ranks - 1;
            s.failure = None;
            sh.start.notify_all();
        }
        let own = catch_unwind(AssertUnwindSafe(|| f(0)));
        if own.is_err() {
            (sh.abort)();
        }
        let mut s = sh.state.lock().unwrap_or_else(|p| p.into_inner());
        while s.pending > 0 {
            s = sh.done.wait(s).unwrap_or_else(|p| p.into_inner());
        }
        s.job = None;
        let failure = s.failure.take();
        drop(s);
        if let Err(p) = own {
            resume_unwind(p);
        }
        if let Some((r, msg)) = failure {
            panic!("tensor-parallel rank {r} failed: {msg}");
        }
    }
}

fn rank_loop(sh: &Shared, rank: usize) {
    let mut seen = 0;
    loop {
        let job = {
            let mut s = sh.state.lock().unwrap_or_else(|p| p.into_inner());
            while s.generation == seen && !s.shutdown {
                s = sh.start.wait(s).unwrap_or_else(|p| p.into_inner());
            }
            if s.shutdown {
                return;
            }
            seen = s.generation;
            s.job.expect("a job with every new generation")
        };
        // SAFETY: see `Job`; `run` is waiting for this rank.
        let r = catch_unwind(AssertUnwindSafe(|| unsafe { (*job.0)(rank) }));
        if r.is_err() {
            (sh.abort)();
        }
        let mut s = sh.state.lock().unwrap_or_else(|p| p.into_inner());
        if let Err(p) = r {
            s.failure.get_or_insert((rank, message(&*p)));
        }
        s.pending -= 1;
        if s.pending == 0 {
            sh.done.notify_all();
        }
    }
}

impl Drop for RankThreads {
    fn drop(&mut self) {
        self.shared.state.lock().unwrap_or_else(|p| p.into_inner()).shutdown = true;
        self.shared.start.notify_all();
        for h in self.handles.drain(..) {
            let _ = h.join();
        }
    }
}
