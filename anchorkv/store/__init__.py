"""Anchors, keys and the on-disk entry format (Zarr v3); local and S3-compatible backends."""
