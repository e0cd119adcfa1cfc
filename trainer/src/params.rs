//! The flat parameter buffer and its named views.
//!
//! Every parameter of a model lives in one contiguous `f32` buffer (and every gradient in a
//! second buffer of the same layout), so averaging two replicas is one axpy and sending one is
//! one write. [`ParamLayout`] names the pieces: `fc1.weight` is `[256, 784]` at offset 0, and so on.

use std::ops::Range;

use sha2::{Digest, Sha256};

/// One named tensor inside the flat buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParamEntry {
    pub name: String,
    pub shape: Vec<usize>,
    pub offset: usize,
}

impl ParamEntry {
    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Where this tensor sits in the flat buffer.
    pub fn range(&self) -> Range<usize> {
        self.offset..self.offset + self.len()
    }
}

/// Names, shapes and offsets of every tensor in a flat parameter buffer, in buffer order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ParamLayout {
    entries: Vec<ParamEntry>,
    len: usize,
}

impl ParamLayout {
    /// Appends a tensor and returns its range in the flat buffer.
    pub fn push(&mut self, name: impl Into<String>, shape: &[usize]) -> Range<usize> {
        let entry = ParamEntry {
            name: name.into(),
            shape: shape.to_vec(),
            offset: self.len,
        };
        self.len += entry.len();
        let range = entry.range();
        self.entries.push(entry);
        range
    }

    pub fn entries(&self) -> &[ParamEntry] {
        &self.entries
    }

    pub fn get(&self, name: &str) -> Option<&ParamEntry> {
        self.entries.iter().find(|e| e.name == name)
    }

    /// Total number of values in the flat buffer.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// A short hash of the tensors' names and shapes in buffer order (one line
    /// `name [shape] float32` each): two replicas mix only if their fingerprints match. It is
    /// the hash of the model description peers exchange (the daemon's `model` module), so a
    /// replica trained elsewhere (a PyTorch model of the same tensors) has the same one.
    pub fn fingerprint(&self) -> String {
        let mut text = String::new();
        for e in &self.entries {
            text.push_str(&format!("{} {:?} float32\n", e.name, e.shape));
        }
        let digest = Sha256::digest(text.as_bytes());
        digest[..8].iter().map(|b| format!("{b:02x}")).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_are_packed_back_to_back() {
        let mut layout = ParamLayout::default();
        assert_eq!(layout.push("a.weight", &[3, 2]), 0..6);
        assert_eq!(layout.push("a.bias", &[3]), 6..9);
        assert_eq!(layout.len(), 9);
        assert_eq!(layout.get("a.bias").map(ParamEntry::range), Some(6..9));
        assert!(layout.get("missing").is_none());
    }

    /// The fingerprint is a function of the names and shapes in order, nothing else: a
    /// golden value, so that a change to it (which splits runs across versions) is seen.
    #[test]
    fn the_fingerprint_hashes_names_and_shapes_in_order() {
        let mut layout = ParamLayout::default();
        layout.push("a.weight", &[3, 2]);
        layout.push("a.bias", &[3]);
        assert_eq!(layout.fingerprint(), "b7dc189dfb24028d");
        let mut swapped = ParamLayout::default();
        swapped.push("a.bias", &[3]);
        swapped.push("a.weight", &[3, 2]);
        assert_ne!(swapped.fingerprint(), layout.fingerprint());
    }
}
