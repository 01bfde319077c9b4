"""The checkpoint: files on disk made into an index of where every tensor's bytes are.

Readers of each format (safetensors headers and indexes, DeepSpeed's native ``.pt`` files, FP8
scale pairs, Hub snapshots), the files they opened, digests of their data, and what the page
cache holds of them. Nothing here knows the model.
"""
