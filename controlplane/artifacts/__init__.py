"""Artifacts: sha256 manifests of model folders and the store drafters travel through.

``manifest`` hashes and verifies folders (every listed file, every load); ``store`` moves
verified folders between a worker's disk and a shared ``file://`` or ``s3://`` location.
"""
