//! The model list and adapter management routes: `/v1/models` (the base model and every loaded
//! adapter as model cards), `/v1/lora_adapters`, and loading / unloading adapters in vLLM's
//! (`/v1/load_lora_adapter`) and SGLang's (`/load_lora_adapter`) forms.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Map, Value};

use crate::adapters::{resolve_adapter_path, PathError};
use crate::backend::AdapterInfo;
use crate::error::ApiError;
use crate::limits::{check_adapter_name, shown_path};
use crate::request;
use crate::server::{body_bytes, now_secs, AppState};

fn adapter_card(st: &AppState, a: &AdapterInfo) -> Value {
    json!({
        "id": a.name, "object": "model", "created": now_secs(), "owned_by": "quiver",
        "root": shown_path(st.cfg.lora_dir.as_deref(), &a.path), "parent": st.served(), "max_model_len": st.backend.max_model_len(),
        "version": a.version, "pinned": a.pinned, "rank": a.rank, "permission": []
    })
}

fn base_card(st: &AppState, id: &str) -> Value {
    json!({
        "id": id, "object": "model", "created": now_secs(), "owned_by": "quiver",
        "root": st.cfg.model_path, "parent": Value::Null, "max_model_len": st.backend.max_model_len(), "permission": []
    })
}

pub(crate) async fn list_models(State(st): State<Arc<AppState>>) -> Json<Value> {
    let mut data = vec![base_card(&st, st.served())];
    data.extend(st.backend.adapters().iter().map(|a| adapter_card(&st, a)));
    Json(json!({"object": "list", "data": data}))
}

/// `GET /v1/models/{id}`: the card of the base model (any served name) or of a loaded adapter.
pub(crate) async fn get_model(State(st): State<Arc<AppState>>, axum::extract::Path(id): axum::extract::Path<String>) -> Result<Json<Value>, ApiError> {
    if st.cfg.served_model_names.contains(&id) {
        return Ok(Json(base_card(&st, &id)));
    }
    match st.backend.adapters().iter().find(|a| a.name == id) {
        Some(a) => Ok(Json(adapter_card(&st, a))),
        None => Err(ApiError::model_not_found(&id)),
    }
}

pub(crate) async fn list_adapters(State(st): State<Arc<AppState>>) -> Json<Value> {
    let dir = st.cfg.lora_dir.as_deref();
    Json(Value::Array(st.backend.adapters().iter().map(|a| json!({"name": a.name, "path": shown_path(dir, &a.path), "version": a.version, "pinned": a.pinned, "rank": a.rank})).collect()))
}

// ---------------------------------------------------------------------------------------------
// Adapter management

struct LoadReq {
    name: String,
    path: String,
    pinned: bool,
    load_inplace: bool,
    expected_version: Option<u64>,
}

fn parse_load(body: &[u8]) -> Result<LoadReq, ApiError> {
    let m = request::parse_object(body)?;
    let f = request::Fields::new(&m);
    let name = f.required_str("lora_name")?.trim().to_string();
    let path = f.required_str("lora_path")?.to_string();
    let expected_version = match f.i64("expected_version")?.or(f.i64("expected_generation")?) {
        Some(v) if v < 0 => return Err(ApiError::field("expected_version", "`expected_version` must be >= 0")),
        v => v.map(|v| v as u64),
    };
    Ok(LoadReq { name, path, pinned: f.bool("pinned")?.unwrap_or(false), load_inplace: f.bool("load_inplace")?.unwrap_or(false), expected_version })
}

async fn do_load(st: &Arc<AppState>, r: LoadReq) -> Result<AdapterInfo, ApiError> {
    if !st.cfg.lora_enabled {
        return Err(ApiError::bad_request("LoRA is not enabled; start the server with --enable-lora (or --lora-dir / --lora-modules / --lora-paths)"));
    }
    check_adapter_name("lora_name", &r.name)?;
    if st.cfg.served_model_names.contains(&r.name) {
        return Err(ApiError::field("lora_name", format!("`lora_name` {:?} is not allowed: it must differ from the base model's name", r.name)));
    }
    let path = resolve_adapter_path(st.cfg.lora_dir.as_deref(), &r.path).map_err(|e| match e {
        PathError::Outside(m) => ApiError::field("lora_path", m),
        PathError::Missing(m) => ApiError { status: StatusCode::NOT_FOUND, message: m, param: Some("lora_path".into()) },
    })?;
    let _g = st.adapter_lock.lock().await;
    if !r.load_inplace && st.backend.adapters().iter().any(|a| a.name == r.name) {
        return Err(ApiError::field("lora_name", format!("The lora adapter '{}' has already been loaded. Use load_inplace to replace it.", r.name)));
    }
    let b = st.backend.clone();
    let res = tokio::task::spawn_blocking(move || b.load_adapter(&r.name, &path, r.pinned, r.load_inplace, r.expected_version)).await.map_err(|e| ApiError::internal(e.to_string()))?;
    Ok(res?)
}

async fn do_unload(st: &Arc<AppState>, body: &[u8]) -> Result<String, ApiError> {
    let m = request::parse_object(body)?;
    let f = request::Fields::new(&m);
    let name = f.required_str("lora_name")?.trim().to_string();
    check_adapter_name("lora_name", &name)?;
    let _g = st.adapter_lock.lock().await;
    if !st.backend.adapters().iter().any(|a| a.name == name) {
        return Err(ApiError { status: StatusCode::NOT_FOUND, message: format!("The lora adapter '{name}' cannot be found."), param: Some("lora_name".into()) });
    }
    let b = st.backend.clone();
    let n2 = name.clone();
    tokio::task::spawn_blocking(move || b.unload_adapter(&n2)).await.map_err(|e| ApiError::internal(e.to_string()))??;
    st.metrics.forget_adapter(&name);
    Ok(name)
}

pub(crate) async fn v1_load(State(st): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    let body = body_bytes(body)?;
    let info = do_load(&st, parse_load(&body)?).await?;
    tracing::info!(adapter = %info.name, version = info.version, "adapter loaded");
    Ok((StatusCode::OK, format!("Success: LoRA adapter '{}' added successfully (version {}).", info.name, info.version)).into_response())
}

pub(crate) async fn v1_unload(State(st): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    let body = body_bytes(body)?;
    let name = do_unload(&st, &body).await?;
    Ok((StatusCode::OK, format!("Success: LoRA adapter '{name}' removed successfully.")).into_response())
}

fn sgl_reply(st: &AppState, r: Result<(), ApiError>) -> Response {
    let loaded: Map<String, Value> = st.backend.adapters().iter().map(|a| (a.name.clone(), Value::from(shown_path(st.cfg.lora_dir.as_deref(), &a.path)))).collect();
    match r {
        Ok(()) => Json(json!({"success": true, "error_message": "", "loaded_adapters": loaded})).into_response(),
        Err(e) => {
            let status = if e.status == StatusCode::CONFLICT { StatusCode::CONFLICT } else { StatusCode::BAD_REQUEST };
            (status, Json(json!({"success": false, "error_message": e.message, "loaded_adapters": loaded}))).into_response()
        }
    }
}

pub(crate) async fn sgl_load(State(st): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Response {
    let r = async {
        let body = body_bytes(body)?;
        do_load(&st, parse_load(&body)?).await.map(|_| ())
    }
    .await;
    sgl_reply(&st, r)
}

pub(crate) async fn sgl_unload(State(st): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Response {
    let r = async {
        let body = body_bytes(body)?;
        do_unload(&st, &body).await.map(|_| ())
    }
    .await
    .map_err(|mut e| {
        if e.status == StatusCode::NOT_FOUND {
            let names: Vec<String> = st.backend.adapters().into_iter().map(|a| a.name).collect();
            e.message = format!("{} Loaded LoRAs: {}", e.message.replace("The lora adapter", "LoRA with name").replace("cannot be found.", "does not exist."), names.join(", "));
        }
        e
    });
    sgl_reply(&st, r)
}
