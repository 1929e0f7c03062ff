"""The manager inside trainers that run the loop themselves: torchtnt (:mod:`.tnt`).

Each integration imports its trainer only when imported itself: ``from
torchrec_cnr.trainers.tnt import TorchtntCheckpointer`` needs torchtnt (``pip install
'torchrec_cnr[tnt]'``), nothing else does.
"""
