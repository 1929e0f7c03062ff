"""Helpers for testing a job against a store, as ``torch.testing`` and
``torchrec.test_utils`` are for theirs: nothing of a checkpoint's path imports them.

- :mod:`torchrec_cnr.testing.stores`: local servers of the object stores a root may live in
  (moto's S3, ``gcp-storage-emulator``'s GCS, Azurite's Azure Blob Storage), each in a
  process of its own on loopback, to run a job or a test against a store without an account.
- :mod:`torchrec_cnr.testing.rows`: exactly these rows modified since the last checkpoint.
- :mod:`torchrec_cnr.testing.memory`: this process's resident memory and its peak.

The servers need the test tools (moto, ``gcp-storage-emulator``; Azurite from npm), which
the ``dev`` extras and ``scripts/setup_env.sh`` install; a user's job never needs them.
"""
