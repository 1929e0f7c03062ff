"""The manager inside trainers that run the loop themselves: torchtnt (:mod:`.tnt`) and
Lightning (:mod:`.lightning`).

Each integration imports its trainer only when imported itself: ``from
torchrec_cnr.trainers.tnt import TorchtntCheckpointer`` needs torchtnt (``pip install
'torchrec_cnr[tnt]'``), ``from torchrec_cnr.trainers.lightning import
LightningCheckpointer`` needs Lightning (``'torchrec_cnr[lightning]'``), nothing else does.
"""
