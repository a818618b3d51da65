//! Host-side metadata of one forward step, in buffers that are cleared and refilled every step
//! (capacity is kept, so steady-state steps allocate nothing).

/// Which rows of a sequence need logits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogitsFor {
    /// None (a prefill chunk that does not end the prompt).
    None,
    /// The last new token only (normal decoding).
    Last,
    /// Every new token (scoring / logprob tests).
    All,
}

#[derive(Default, Debug)]
pub struct ForwardBatch {
    /// New token ids of all sequences, concatenated. An id `sample::DRAWN | i` stands for the
    /// token drawn for spec `i` of the device's last sample launch, not yet on the host; the
    /// device fills it in before the embedding (`Device::resolve_drawn`).
    pub tokens: Vec<u32>,
    /// Absolute position of each new token.
    pub positions: Vec<u32>,
    /// CSR offsets of each sequence's rows in `tokens` (len = seqs + 1).
    pub seq_starts: Vec<u32>,
    /// Context length of each sequence after this step.
    pub ctx_lens: Vec<u32>,
    /// Block tables, `block_table_stride` entries per sequence.
    pub block_tables: Vec<u32>,
    pub block_table_stride: usize,
    /// Token rows whose logits are returned, in order.
    pub logits_rows: Vec<u32>,
}

impl ForwardBatch {
    /// A hash of everything that fixes the launches of a forward over this batch: row and
    /// sequence layout, block-table size, which rows produce logits. Token ids, positions and
    /// block numbers are data and do not enter it.
    pub fn shape_key(&self) -> u64 {
        use std::hash::{DefaultHasher, Hash, Hasher};
        let mut h = DefaultHasher::new();
        (self.tokens.len(), self.block_tables.len(), self.block_table_stride, &self.seq_starts, &self.logits_rows).hash(&mut h);
        h.finish()
    }

    pub fn with_capacity(max_tokens: usize, max_seqs: usize, block_table_stride: usize) -> Self {
        let mut b = ForwardBatch {
            tokens: Vec::with_capacity(max_tokens),
            positions: Vec::with_capacity(max_tokens),
            seq_starts: Vec::with_capacity(max_seqs + 1),
            ctx_lens: Vec::with_capacity(max_seqs),
            block_tables: Vec::with_capacity(max_seqs * block_table_stride),
            block_table_stride,
            logits_rows: Vec::with_capacity(max_tokens),
        };
        b.seq_starts.push(0);
        b
    }

    /// Empties the batch for the next step (keeps capacity). The stride may change here only.
    pub fn clear(&mut self, block_table_stride: usize) {
        self.tokens.clear();
        self.positions.clear();
        self.seq_starts.clear();
        self.seq_starts.push(0);
        self.ctx_lens.clear();
        self.block_tables.clear();
        self.block_table_stride = block_table_stride;
        self.logits_rows.clear();
    }

    pub fn num_seqs(&self) -> usize {
        self.seq_starts.len() - 1
    }

    /// Appends a sequence whose first new token sits at absolute position `start_pos`; the
    /// block table must cover `start_pos + tokens.len()` positions.
    pub fn push_seq(&mut self, tokens: &[u32], start_pos: usize, block_table: &[u32], logits: LogitsFor) {
        let stride = self.block_table_stride;
        assert!(block_table.len() <= stride, "block table longer than the batch stride");
        let row0 = self.tokens.len() as u32;
        self.tokens.extend_from_slice(tokens);
        self.positions.extend((start_pos..start_pos + tokens.len()).map(|p| p as u32));
        self.seq_starts.push(self.tokens.len() as u32);
        self.ctx_lens.push((start_pos + tokens.len()) as u32);
        self.block_tables.extend_from_slice(block_table);
        self.block_tables.extend(std::iter::repeat_n(0, stride - block_table.len()));
        match logits {
            LogitsFor::None => {}
            LogitsFor::Last if !tokens.is_empty() => self.logits_rows.push(row0 + tokens.len() as u32 - 1),
            LogitsFor::Last => {}
            LogitsFor::All => self.logits_rows.extend(row0..row0 + tokens.len() as u32),
        }
    }
}
