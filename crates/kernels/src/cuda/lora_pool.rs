//! The CUDA LoRA pool: slot buffers in device memory (bf16 A and Bᵀ, the rank / scaling table
//! mirrored as u32 + f32), and adapter images (the pool's bf16 of one adapter in page-locked
//! host memory) so activating an adapter is DMA copies that the host does not wait for.

use super::lora::{dev_buf, split_k, EXPAND_MAX_SMEM, SUB_ROWS};
use super::*;
use crate::lora::{LoraStorage, MAX_SLICES};
use rayon::prelude::*;

/// A CUDA [`LoraImage`]'s data: bf16 bits in page-locked memory, and an event recorded after
/// the last copy out of it, which dropping the image waits for (the DMA engine may still be
/// reading it when the host cache lets the adapter go).
struct CudaLoraImage {
    pinned: PinnedBuf,
    copied: sys::CUevent,
}

// SAFETY: the pinned pointer is owned by the image and written only through `&mut` (filling);
// the event is a handle of the device's context.
unsafe impl Send for CudaLoraImage {}
unsafe impl Sync for CudaLoraImage {}

impl Drop for CudaLoraImage {
    fn drop(&mut self) {
        if self.pinned.ctx.bind_to_thread().is_ok() {
            // SAFETY: an event of this context; after it fires no copy reads the pinned memory.
            unsafe {
                let _ = result::event::synchronize(self.copied);
                let _ = result::event::destroy(self.copied);
            }
        }
    }
}

/// f32 → bf16 bits, round to nearest even, over many threads for large slices (an 8B rank-16
/// adapter is 42M values).
fn to_bf16_bits(src: &[f32], dst: &mut [u16]) {
    const PIECE: usize = 1 << 16;
    dst.par_chunks_mut(PIECE).zip(src.par_chunks(PIECE)).for_each(|(d, s)| {
        for (d, &x) in d.iter_mut().zip(s) {
            *d = half::bf16::from_f32(x).to_bits();
        }
    });
}

impl CudaDevice {
    pub(super) fn lora_alloc_site_impl(&self, shape: LoraSiteShape) -> LoraSiteBuffers {
        let mk = |elems: usize| LoraStorage::Cuda(DevBuf::zeroed(&self.ctx, elems * 2).unwrap_or_else(|e| panic!("LoRA pool on {}: {e:#}", self.name)));
        let smem = SUB_ROWS * shape.shrink_width() * 4;
        assert!(smem <= EXPAND_MAX_SMEM, "LoRA pool rank {} is too large for the CUDA expand (at most {} for a 3-slice site)", shape.max_rank, EXPAND_MAX_SMEM / (SUB_ROWS * 3 * 4));
        let mut g = self.lora_geom.lock().unwrap();
        g.width = g.width.max(shape.shrink_width());
        g.splits = g.splits.max(split_k(shape.in_dim).1);
        g.out = g.out.max(shape.out_dim());
        LoraSiteBuffers { a: mk(shape.slots * shape.a_slot_len()), b: mk(shape.slots * shape.b_slot_len()), shape, tail: Default::default() }
    }

    pub(super) fn lora_alloc_table_impl(&self, entries: usize, slots: usize) -> LoraTable {
        let mut t = LoraTable::host(entries, slots);
        let words = entries * slots * (1 + MAX_SLICES);
        t.device = Some(LoraStorage::Cuda(DevBuf::zeroed(&self.ctx, words * 4).unwrap_or_else(|e| panic!("LoRA table on {}: {e:#}", self.name))));
        t
    }

    /// Converts the slot to bf16 on the host and copies it over on the compute stream, so work
    /// queued before (a step still reading the old adapter) finishes first.
    pub(super) fn lora_write_slot_impl(&self, buf: &mut LoraSiteBuffers, slot: usize, fill: &mut dyn FnMut(&mut [f32], &mut [f32])) {
        self.bind();
        let (al, bl) = (buf.shape.a_slot_len(), buf.shape.b_slot_len());
        let mut a = vec![0.0f32; al];
        let mut b = vec![0.0f32; bl];
        fill(&mut a, &mut b);
        let to_bf16 = |v: &[f32]| v.iter().map(|&x| half::bf16::from_f32(x)).collect::<Vec<half::bf16>>();
        self.htod(dev_buf(&buf.a).ptr + (slot * al * 2) as u64, &to_bf16(&a));
        self.htod(dev_buf(&buf.b).ptr + (slot * bl * 2) as u64, &to_bf16(&b));
    }

    pub(super) fn lora_sync_table_impl(&self, table: &mut LoraTable) {
        self.bind();
        let Some(d) = &table.device else { return };
        let d = dev_buf(d).ptr;
        self.htod(d, &table.ranks);
        self.htod(d + (table.ranks.len() * 4) as u64, &table.scalings);
    }

    pub(super) fn lora_image_impl(&self, elems: usize) -> LoraImage {
        let pinned = PinnedBuf::new(&self.ctx, elems * 2).unwrap_or_else(|e| panic!("LoRA adapter image on {}: {e:#}", self.name));
        let copied = result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING).unwrap_or_else(|e| panic!("LoRA image event on {}: {e:?}", self.name));
        LoraImage { elems, filled: false, layout: 0, data: Box::new(CudaLoraImage { pinned, copied }) }
    }

    pub(super) fn lora_image_fill_impl(&self, image: &mut LoraImage, offset: usize, shape: LoraSiteShape, fill: &mut dyn FnMut(&mut [f32], &mut [f32])) {
        let (al, bl) = (shape.a_slot_len(), shape.b_slot_len());
        assert!(offset + al + bl <= image.elems, "LoRA image of {} elements too small for a site at {offset}", image.elems);
        let img = image.data.downcast_mut::<CudaLoraImage>().expect("a CUDA LoRA image");
        let mut scratch = self.lora_fill_scratch.lock().unwrap();
        let (a, b) = &mut *scratch;
        a.clear();
        a.resize(al, 0.0);
        b.clear();
        b.resize(bl, 0.0);
        fill(a, b);
        let bits = img.pinned.slice_mut::<u16>(image.elems);
        let (da, db) = bits[offset..offset + al + bl].split_at_mut(al);
        to_bf16_bits(a, da);
        to_bf16_bits(b, db);
    }

    pub(super) fn lora_write_slot_image_impl(&self, buf: &mut LoraSiteBuffers, slot: usize, image: &LoraImage, offset: usize) {
        self.bind();
        let (al, bl) = (buf.shape.a_slot_len(), buf.shape.b_slot_len());
        assert!(image.filled && offset + al + bl <= image.elems, "LoRA image {image:?} has no site of {} elements at {offset}", al + bl);
        let img = image.data.downcast_ref::<CudaLoraImage>().expect("a CUDA LoRA image");
        // SAFETY: in bounds (asserted); the pinned memory is not written while the image is
        // shared (filling takes `&mut`), and it lives until `copied` fires (Drop waits).
        let src = unsafe { std::slice::from_raw_parts((img.pinned.ptr as *const u16).add(offset), al + bl) };
        self.touch();
        let fail = |e: cudarc::driver::DriverError| -> ! { panic!("LoRA slot copy on {}: {e:?}", self.name) };
        // SAFETY: destinations are this slot's A and Bᵀ in the site's buffers; page-locked
        // sources, so the copies run on the DMA engine in stream order and the host returns.
        unsafe {
            result::memcpy_htod_async(dev_buf(&buf.a).ptr + (slot * al * 2) as u64, &src[..al], self.stream).unwrap_or_else(|e| fail(e));
            result::memcpy_htod_async(dev_buf(&buf.b).ptr + (slot * bl * 2) as u64, &src[al..], self.stream).unwrap_or_else(|e| fail(e));
            result::event::record(img.copied, self.stream).unwrap_or_else(|e| fail(e));
        }
    }
}
