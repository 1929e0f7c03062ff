"""cnr_train: the training application around torchrec_cnr, kept apart from the library.

A config-driven DLRM job (``config``, ``config_file``), its synthetic and Criteo data
(``workload``, ``criteo``), the job itself (``job``) and its command line (``cli``,
``cnr-train``). Its ranks start with the library's ``torchrec_cnr.launch``.
"""
