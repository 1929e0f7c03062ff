"""PyTorch's checkpoint format: DCP checkpoints imported into a live model
(``CheckpointManager.restore(from_dcp=...)``), committed steps exported as DCP checkpoints
a job trains on from with stock ``dcp.load``, and a stager that lets ``dcp.async_save``
save a TorchRec model copy-on-write (:class:`DcpStager`). Its names import on first use
(:mod:`torchrec_cnr.lazy`): an export needs no TorchRec."""

from typing import TYPE_CHECKING

from torchrec_cnr.lazy import exports, listing

if TYPE_CHECKING:
    from torchrec_cnr.interop.dcp_export import DcpExport, ExportOptions, export_dcp
    from torchrec_cnr.interop.dcp_import import import_dcp
    from torchrec_cnr.interop.dcp_stager import DcpStager

__all__ = ["DcpExport", "DcpStager", "ExportOptions", "export_dcp", "import_dcp"]

__getattr__ = exports(
    globals(),
    {
        ".dcp_export": ("DcpExport", "ExportOptions", "export_dcp"),
        ".dcp_import": ("import_dcp",),
        ".dcp_stager": ("DcpStager",),
    },
)
__dir__ = listing(globals())
