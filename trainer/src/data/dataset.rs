//! In-memory labelled image datasets. Pixels stay as bytes (a quarter of the memory of `f32`)
//! and are scaled to `[0, 1]` only when a batch is assembled.

use std::path::{Path, PathBuf};

use rand::rngs::ChaCha8Rng;
use rand::seq::SliceRandom;
use rand::{RngExt, SeedableRng};

use super::{DataError, idx};
use crate::model::{CLASSES, IMAGE_SIDE};

/// Which half of the data.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Split {
    Train,
    Test,
}

impl Split {
    /// File name stem used by (Fashion-)MNIST.
    fn stem(self) -> &'static str {
        match self {
            Split::Train => "train",
            Split::Test => "t10k",
        }
    }

    pub fn images_file(self) -> String {
        format!("{}-images-idx3-ubyte", self.stem())
    }

    pub fn labels_file(self) -> String {
        format!("{}-labels-idx1-ubyte", self.stem())
    }
}

/// Labelled greyscale images, `rows x cols` bytes each.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Dataset {
    images: Vec<u8>,
    labels: Vec<u8>,
    rows: usize,
    cols: usize,
}

impl Dataset {
    /// Loads one split from a directory of IDX files (`.gz` or raw).
    pub fn load(dir: &Path, split: Split) -> Result<Self, DataError> {
        if !dir.is_dir() {
            return Err(DataError::MissingDir {
                dir: dir.to_owned(),
            });
        }
        let images_path = find(dir, &split.images_file())?;
        let labels_path = find(dir, &split.labels_file())?;
        let images = idx::read(&images_path, 3)?;
        let labels = idx::read(&labels_path, 1)?;
        if images.dims[0] != labels.dims[0] {
            return Err(DataError::Corrupt {
                path: labels_path,
                reason: format!(
                    "it has {} labels but `{}` has {} images",
                    labels.dims[0],
                    images_path.display(),
                    images.dims[0]
                ),
            });
        }
        if let Some(at) = labels.data.iter().position(|&l| usize::from(l) >= CLASSES) {
            return Err(DataError::Corrupt {
                path: labels_path,
                reason: format!("label {} at index {at} is not a class 0-9", labels.data[at]),
            });
        }
        Ok(Dataset {
            images: images.data,
            labels: labels.data,
            rows: images.dims[1],
            cols: images.dims[2],
        })
    }

    /// A small learnable dataset of 28x28 images for tests: each class is a fixed random
    /// pattern (the same for every seed, so sets drawn with different seeds are train and test
    /// sets of one task) plus per-sample noise. The same `seed` always gives the same data.
    pub fn synthetic(samples: usize, seed: u64) -> Self {
        let side = IMAGE_SIDE * IMAGE_SIDE;
        let mut task = ChaCha8Rng::seed_from_u64(0x5eed);
        let prototypes: Vec<Vec<u8>> = (0..CLASSES)
            .map(|_| (0..side).map(|_| task.random_range(0..=160u8)).collect())
            .collect();
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut images = Vec::with_capacity(samples * side);
        let mut labels = Vec::with_capacity(samples);
        for _ in 0..samples {
            let label = rng.random_range(0..CLASSES);
            labels.push(label as u8);
            images.extend(
                prototypes[label]
                    .iter()
                    .map(|&p| p + rng.random_range(0..=95u8)),
            );
        }
        Dataset {
            images,
            labels,
            rows: IMAGE_SIDE,
            cols: IMAGE_SIDE,
        }
    }

    pub fn len(&self) -> usize {
        self.labels.len()
    }

    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }

    /// `(rows, cols)` of every image.
    pub fn image_shape(&self) -> (usize, usize) {
        (self.rows, self.cols)
    }

    pub fn sample_len(&self) -> usize {
        self.rows * self.cols
    }

    pub fn labels(&self) -> &[u8] {
        &self.labels
    }

    /// Samples per class.
    pub fn label_counts(&self) -> [usize; CLASSES] {
        let mut counts = [0; CLASSES];
        for &l in &self.labels {
            counts[usize::from(l)] += 1;
        }
        counts
    }

    /// The samples at `indices`, in that order.
    pub fn subset(&self, indices: &[usize]) -> Dataset {
        let n = self.sample_len();
        Dataset {
            images: indices
                .iter()
                .flat_map(|&i| &self.images[i * n..(i + 1) * n])
                .copied()
                .collect(),
            labels: indices.iter().map(|&i| self.labels[i]).collect(),
            rows: self.rows,
            cols: self.cols,
        }
    }

    /// Fills `images` with the samples at `indices` scaled to `[0, 1]`, and `labels` with
    /// their classes.
    pub fn fill_batch(&self, indices: &[u32], images: &mut Vec<f32>, labels: &mut Vec<u32>) {
        let n = self.sample_len();
        images.clear();
        labels.clear();
        for &i in indices {
            let i = i as usize;
            images.extend(
                self.images[i * n..(i + 1) * n]
                    .iter()
                    .map(|&p| f32::from(p) / 255.0),
            );
            labels.push(u32::from(self.labels[i]));
        }
    }

    /// Writes this dataset as the uncompressed `split` of `dir`, so that `dir` can be loaded
    /// like any dataset directory.
    pub fn write_split(&self, dir: &Path, split: Split) -> std::io::Result<()> {
        idx::write(
            &dir.join(split.images_file()),
            &[self.len(), self.rows, self.cols],
            &self.images,
        )?;
        idx::write(&dir.join(split.labels_file()), &[self.len()], &self.labels)
    }
}

fn find(dir: &Path, name: &str) -> Result<PathBuf, DataError> {
    [dir.join(format!("{name}.gz")), dir.join(name)]
        .into_iter()
        .find(|p| p.is_file())
        .ok_or_else(|| DataError::MissingFile {
            dir: dir.to_owned(),
            name: name.to_owned(),
        })
}

/// The order in which epoch `epoch` visits `len` samples: a permutation that depends only on
/// `(seed, epoch)`, so a run resumed at any step sees the same batches as an uninterrupted one.
pub fn epoch_order(len: usize, seed: u64, epoch: u64) -> Vec<u32> {
    let stream = seed ^ (epoch + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    let mut rng = ChaCha8Rng::seed_from_u64(stream);
    let mut order: Vec<u32> = (0..len as u32).collect();
    order.shuffle(&mut rng);
    order
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_dir_says_how_to_get_the_data() {
        let err = Dataset::load(Path::new("/no/such/dir"), Split::Train).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("apt-get install dataset-fashion-mnist"),
            "{msg}"
        );
        assert!(msg.contains("--data DIR"), "{msg}");
    }

    #[test]
    fn missing_file_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let err = Dataset::load(dir.path(), Split::Test).unwrap_err();
        assert!(err.to_string().contains("t10k-images-idx3-ubyte"), "{err}");
    }

    #[test]
    fn train_split_round_trips_through_files() {
        let data = Dataset::synthetic(50, 3);
        let dir = tempfile::tempdir().unwrap();
        data.write_split(dir.path(), Split::Train).unwrap();
        assert_eq!(Dataset::load(dir.path(), Split::Train).unwrap(), data);
    }

    #[test]
    fn label_out_of_range_is_corrupt() {
        let dir = tempfile::tempdir().unwrap();
        let mut data = Dataset::synthetic(5, 3);
        data.labels[2] = 12;
        data.write_split(dir.path(), Split::Train).unwrap();
        let err = Dataset::load(dir.path(), Split::Train).unwrap_err();
        assert!(err.to_string().contains("label 12 at index 2"), "{err}");
    }

    #[test]
    fn image_and_label_counts_must_agree() {
        let dir = tempfile::tempdir().unwrap();
        let data = Dataset::synthetic(5, 3);
        data.write_split(dir.path(), Split::Train).unwrap();
        idx::write(&dir.path().join(Split::Train.labels_file()), &[4], &[0; 4]).unwrap();
        let err = Dataset::load(dir.path(), Split::Train).unwrap_err();
        assert!(err.to_string().contains("4 labels"), "{err}");
    }

    #[test]
    fn batches_are_scaled_to_unit_range() {
        let data = Dataset::synthetic(4, 1);
        let (mut x, mut y) = (Vec::new(), Vec::new());
        data.fill_batch(&[3, 0], &mut x, &mut y);
        assert_eq!(x.len(), 2 * 784);
        assert_eq!(y, [u32::from(data.labels[3]), u32::from(data.labels[0])]);
        assert!(x.iter().all(|v| (0.0..=1.0).contains(v)));
    }

    #[test]
    fn epoch_order_is_a_deterministic_permutation() {
        let a = epoch_order(100, 5, 0);
        assert_eq!(a, epoch_order(100, 5, 0));
        assert_ne!(a, epoch_order(100, 5, 1));
        assert_ne!(a, epoch_order(100, 6, 0));
        let mut sorted = a.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..100).collect::<Vec<u32>>());
    }
}
