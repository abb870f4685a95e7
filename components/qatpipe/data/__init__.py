"""Datasets: KITTI reader, synthetic KITTI generator and the tf.data input pipeline (the S3 cache is ../storage.py)."""
