"""Datasets: KITTI reader, synthetic KITTI generator, S3 cache and the tf.data input pipeline."""
