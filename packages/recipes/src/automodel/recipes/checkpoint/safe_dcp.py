"""Reading DCP checkpoints without running code from them.

torch's ``FileSystemReader.read_metadata`` (torch 2.11-2.13) reads the ``.metadata`` file with a
plain ``pickle.load``, and ``DefaultLoadPlanner.load_bytes`` reads every non-tensor entry with
``torch.load(weights_only=False)``: a checkpoint written by someone else could run arbitrary code
on load. Tensor entries are already read with ``torch.load(weights_only=True)``.

`SafeFileSystemReader` reads the metadata through `MetadataUnpickler`, which resolves only the
classes a DCP metadata file is made of (the dataclasses of ``torch.distributed.checkpoint.metadata``,
``torch.Size``, dtypes, layouts, paths) and refuses every other global, so unpickling it cannot
call anything else. `SafeLoadPlanner` reads non-tensor entries with ``weights_only=True``. The
metadata file is still a pickle: the unpickler restricts what it may build, it does not turn the
format into data-only JSON.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from automodel.recipes.torch_internals import EmptyStateDictLoadPlanner, metadata_path, set_element

_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_ALLOWED_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    {
        (_METADATA_MODULE, "Metadata"),
        (_METADATA_MODULE, "MetadataIndex"),
        (_METADATA_MODULE, "ChunkStorageMetadata"),
        (_METADATA_MODULE, "TensorStorageMetadata"),
        (_METADATA_MODULE, "BytesStorageMetadata"),
        (_METADATA_MODULE, "TensorProperties"),
        (_METADATA_MODULE, "StorageMeta"),
        (_METADATA_MODULE, "_MEM_FORMAT_ENCODING"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("collections", "OrderedDict"),
        ("pathlib", "Path"),
        ("pathlib", "PosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib", "PureWindowsPath"),
        ("pathlib._local", "PosixPath"),
        ("pathlib._local", "WindowsPath"),
        ("pathlib._local", "PurePosixPath"),
        ("pathlib._local", "PureWindowsPath"),
    }
)


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint file asks to build something a DCP metadata file never holds."""


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles a DCP ``.metadata`` file, resolving only an allow-list of globals."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpointError(
            f"DCP metadata refers to {module}.{name}, which a checkpoint's metadata never holds; "
            "refusing to load it (the file may have been crafted to run code)"
        )


def load_metadata(stream: Any) -> Metadata:
    """A DCP `Metadata` read from `stream` with `MetadataUnpickler`."""
    metadata = MetadataUnpickler(stream).load()
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(f"DCP metadata holds a {type(metadata).__name__}, not a Metadata")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """`FileSystemReader` whose metadata is read by `MetadataUnpickler` instead of ``pickle.load``."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = metadata_path(self, kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as metadata_file:
            metadata = load_metadata(metadata_file)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """`DefaultLoadPlanner` reading non-tensor entries with ``torch.load(weights_only=True)``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


class SafeEmptyStateDictLoadPlanner(EmptyStateDictLoadPlanner):
    """torch's planner that rebuilds the whole state dict from metadata, with weights-only bytes."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        SafeLoadPlanner.load_bytes(self, read_item, value)  # type: ignore[arg-type]
