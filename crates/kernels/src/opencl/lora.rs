//! LoRA on OpenCL: the pool's slot buffers in device memory (f32 A and Bᵀ, the rank / scaling
//! table mirrored as u32 + f32 words in one buffer), and `Device::lora_apply` as two launches
//! over the tiles staged with the batch (kernels in `lora.cl`): the shrink `t = x · Aᵀ` (or the
//! embedding's column gather) into a scratch buffer, then the expand with per-slice scaling and
//! the add into the base output fused, for 1-, 2- and 3-slice sites alike. A DPAS kernel set runs
//! both on the XMX units (`dpas_lora_shrink`, `dpas_lora_expand` in dpas.cl; the shrink where the
//! input width is a multiple of 16); the embedding's gather is the portable kernel everywhere.

use super::*;
use crate::lora::{packed_len, LoraStorage, MAX_SLICES};

/// Most rows per tile of the packed groups (`LORA_TILE` in lora.cl).
pub(super) const TILE_ROWS: usize = 16;

fn cl_buf(s: &LoraStorage) -> &ClBuf {
    match s {
        LoraStorage::OpenCl(b) => b,
        _ => panic!("OpenCL LoRA op given LoRA storage of another device (allocate it with the OpenCL device)"),
    }
}

impl OpenClDevice {
    pub(super) fn lora_alloc_site_impl(&self, shape: LoraSiteShape) -> LoraSiteBuffers {
        let mk = |elems: usize| LoraStorage::OpenCl(self.zeroed(elems * 4));
        LoraSiteBuffers { a: mk(shape.slots * shape.a_slot_len()), b: mk(shape.slots * shape.b_slot_len()), shape, tail: Default::default() }
    }

    pub(super) fn lora_alloc_table_impl(&self, entries: usize, slots: usize) -> LoraTable {
        let mut t = LoraTable::host(entries, slots);
        t.device = Some(LoraStorage::OpenCl(self.zeroed(entries * slots * (1 + MAX_SLICES) * 4)));
        t
    }

    /// Writes the whole slot (zeroed, then the adapter): a reused slot keeps no tail of its
    /// previous adapter. The in-order queue runs it after every step queued before.
    pub(super) fn lora_write_slot_impl(&self, buf: &mut LoraSiteBuffers, slot: usize, fill: &mut dyn FnMut(&mut [f32], &mut [f32])) {
        let (al, bl) = (buf.shape.a_slot_len(), buf.shape.b_slot_len());
        let mut a = vec![0.0f32; al];
        let mut b = vec![0.0f32; bl];
        fill(&mut a, &mut b);
        let LoraStorage::OpenCl(ab) = &mut buf.a else { panic!("OpenCL lora_write_slot given LoRA storage of another device") };
        self.write(ab, slot * al * 4, &a);
        let LoraStorage::OpenCl(bb) = &mut buf.b else { panic!("OpenCL lora_write_slot given LoRA storage of another device") };
        self.write(bb, slot * bl * 4, &b);
    }

    pub(super) fn lora_sync_table_impl(&self, table: &mut LoraTable) {
        let words = table.ranks.len();
        let Some(LoraStorage::OpenCl(d)) = &mut table.device else { return };
        self.write(d, 0, &table.ranks);
        self.write(d, words * 4, &table.scalings);
    }

    pub(super) fn lora_apply_impl(&self, call: &LoraCall<'_>, x: LoraX<'_>, y: &mut Tensor) {
        let g = &call.groups;
        let cap = g.rows;
        if cap == 0 || g.adapter_rows == 0 {
            return;
        }
        assert!(g.packed.len() == packed_len(cap), "OpenCL lora_apply needs the groups packed for {cap} rows (LoraGroups::packed)");
        let tiles = g.packed[0] as usize;
        if tiles == 0 {
            return;
        }
        let sh = call.shape();
        let (a, b) = (cl_buf(&call.buffers.a).mem(), cl_buf(&call.buffers.b).mem());
        let table = cl_buf(call.table.device.as_ref().expect("an OpenCL LoRA table has a device mirror")).mem();
        let s = call.table.slots;
        let ranks_off = (call.entry * s) as i32;
        let scal_off = (call.table.entries * s + call.entry * s * MAX_SLICES) as i32;
        let w = sh.shrink_width();
        let mut st = self.state.lock().unwrap();
        let (gm, g_off) = self.meta_ref(&mut st, g.packed);
        if st.lora_t.bytes < cap * w * 4 {
            st.lora_t = self.zeroed(cap * w * 4);
        }
        let t = st.lora_t.mem();
        match x {
            LoraX::Dense(x) if self.dpas_lanes().is_some() && gemm::dpas_fits(sh.in_dim) => {
                let lanes = self.dpas_lanes().unwrap();
                self.launch(
                    "dpas_lora_shrink",
                    &[w.div_ceil(lanes) * lanes, tiles],
                    Some(&[lanes, 1]),
                    &[Arg::Mem(mem(x)), Arg::Mem(a), Arg::Mem(gm), Arg::I32(g_off), Arg::I32(cap as i32), Arg::Mem(table), Arg::I32(ranks_off), Arg::I32(sh.n_slices as i32), Arg::I32(sh.max_rank as i32), Arg::I32(sh.in_dim as i32), Arg::Mem(t)],
                );
            }
            LoraX::Dense(x) => {
                self.launch(
                    "lora_shrink",
                    &[TILE_ROWS, w, tiles],
                    None,
                    &[Arg::Mem(mem(x)), Arg::Mem(a), Arg::Mem(gm), Arg::I32(g_off), Arg::I32(cap as i32), Arg::Mem(table), Arg::I32(ranks_off), Arg::I32(sh.n_slices as i32), Arg::I32(sh.max_rank as i32), Arg::I32(sh.in_dim as i32), Arg::Mem(t)],
                );
            }
            LoraX::TokenIds(ids) => {
                let (im, ids_off) = self.meta_ref(&mut st, ids);
                assert!(im == gm, "lora_apply: the token ids must be staged with the batch");
                self.launch(
                    "lora_shrink_ids",
                    &[sh.max_rank, TILE_ROWS, tiles],
                    None,
                    &[Arg::Mem(gm), Arg::I32(ids_off), Arg::Mem(a), Arg::I32(g_off), Arg::I32(cap as i32), Arg::Mem(table), Arg::I32(ranks_off), Arg::I32(sh.max_rank as i32), Arg::I32(sh.in_dim as i32), Arg::Mem(t)],
                );
            }
        }
        let out = sh.out_dim();
        let off = |j: usize| if j < sh.n_slices { sh.offsets[j] } else { out } as i32;
        let (name, global, local) = match self.dpas_lanes() {
            Some(l) => ("dpas_lora_expand", [out.div_ceil(l) * l, tiles, 1], Some([l, 1, 1])),
            None => ("lora_expand", [out, TILE_ROWS, tiles], None),
        };
        let dims = if local.is_some() { 2 } else { 3 };
        self.launch(
            name,
            &global[..dims],
            local.as_ref().map(|l| &l[..dims]),
            &[
                Arg::Mem(t),
                Arg::Mem(b),
                Arg::Mem(gm),
                Arg::I32(g_off),
                Arg::I32(cap as i32),
                Arg::Mem(table),
                Arg::I32(ranks_off),
                Arg::I32(scal_off),
                Arg::I32(sh.n_slices as i32),
                Arg::I32(sh.max_rank as i32),
                Arg::I32(sh.b_ld as i32),
                Arg::I32(off(1)),
                Arg::I32(off(2)),
                Arg::I32(out as i32),
                Arg::Mem(mem(y)),
            ],
        );
    }
}
