"""PyTorch's checkpoint format: DCP checkpoints imported into a live model
(``CheckpointManager.restore(from_dcp=...)``), committed steps exported as DCP checkpoints
a job trains on from with stock ``dcp.load``, and a stager that lets ``dcp.async_save``
save a TorchRec model copy-on-write (:class:`DcpStager`)."""

from torchrec_cnr.interop.dcp_export import DcpExport, ExportOptions, export_dcp
from torchrec_cnr.interop.dcp_import import import_dcp
from torchrec_cnr.interop.dcp_stager import DcpStager

__all__ = ["DcpExport", "DcpStager", "ExportOptions", "export_dcp", "import_dcp"]
