"""PyTorch's checkpoint format: DCP checkpoints imported into a live model
(``CheckpointManager.restore(from_dcp=...)``) and committed steps exported as DCP
checkpoints a job trains on from with stock ``dcp.load``."""

from torchrec_cnr.interop.dcp_export import DcpExport, ExportOptions, export_dcp
from torchrec_cnr.interop.dcp_import import import_dcp

__all__ = ["DcpExport", "ExportOptions", "export_dcp", "import_dcp"]
