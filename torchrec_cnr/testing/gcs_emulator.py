"""``gcp-storage-emulator`` with GCS's write precondition, for the tests' GCS roots.

    python torchrec_cnr/testing/gcs_emulator.py start --host 127.0.0.1 --port PORT --in-memory

The emulator accepts ``ifGenerationMatch`` on an upload and ignores it, so two writers
on one of its roots overwrite each other, where GCS refuses the second with 412. This
runs the same emulator with the check GCS makes: an upload that names a generation
other than the object's (``0``: the object exists) is refused with 412 and changes
nothing. The emulator serves one request at a time, so the check and the write are one
step, as on GCS. It imports nothing of this package and runs by its path, so its start
(about a second) does not depend on what the package imports.
"""

from __future__ import annotations

import sys
from http import HTTPStatus
from typing import Any

from gcp_storage_emulator import __main__ as emulator
from gcp_storage_emulator import server
from gcp_storage_emulator.exceptions import NotFound
from gcp_storage_emulator.handlers import objects

_insert = objects.insert


def _object_name(request: Any) -> str | None:
    if "name" in request.query:
        return str(request.query["name"][0])
    if request.query.get("uploadType", [""])[0] == "multipart":
        return request.data["meta"].get("name")  # type: ignore[no-any-return]
    return None


def _insert_if_generation_matches(request: Any, response: Any, storage: Any) -> None:
    """The emulator's upload, refused with 412 unless ``ifGenerationMatch`` holds."""
    wanted = request.query.get("ifGenerationMatch")
    name = _object_name(request)
    if wanted and name is not None:
        try:
            found = str(storage.get_file_obj(request.params["bucket_name"], name)["generation"])
        except NotFound:
            found = "0"
        if found != wanted[0]:
            response.status = HTTPStatus.PRECONDITION_FAILED
            error = {
                "code": 412,
                "message": "Precondition Failed",
                "errors": [{"reason": "conditionNotMet"}],
            }
            response.json({"error": error})
            return
    _insert(request, response, storage)


def main() -> None:
    for _, handlers in server.HANDLERS:
        for method, handler in list(handlers.items()):
            if handler is _insert:
                handlers[method] = _insert_if_generation_matches
    objects.insert = _insert_if_generation_matches  # the router's fallback for bare POSTs
    emulator.main(sys.argv[1:])


if __name__ == "__main__":
    main()
