//! The serving engine: scheduler, paged KV cache, prefix cache, sampling, adapter lifecycle.
//!
//! [`Engine::start`] spawns the engine thread; [`EngineHandle`] is what the HTTP server and
//! the CLI hold. [`Generator`] is the single-sequence path (and the test oracle).

pub mod api;
pub mod bench;
pub mod config;
pub mod engine;
pub mod generate;
pub mod kv;
pub mod sampling;
pub mod structured;
pub mod testing;
pub mod text;

pub use api::{AdapterError, AdapterInfo, AdapterStats, Completion, DebugState, EmbedRequest, EmbedStream, EngineStats, FinishReason, GenerateRequest, RequestStream, StopReason, StreamEvent, SubmitError, TokenLogprob};
pub use config::{EngineConfig, SchedulePolicy, Task};
pub use engine::{Engine, EngineHandle};
pub use generate::{AdapterLora, BaseOnly, GenerateOptions, GenerateStats, Generator, StepLora};
pub use sampling::{SamplingParams, Sampler};
pub use structured::Constraint;
