"""Stub of the native module embstore._core (checked by mypy.stubtest)."""

from typing import Any, final

import numpy as np
import numpy.typing as npt

__version__: str

@final
class MappedTable:
    def __new__(cls, path: str) -> MappedTable: ...
    def refresh(self, wait: float | None = None) -> bool: ...
    def warm(self) -> dict[str, Any]: ...
    def set_warm(self, on: bool) -> None: ...
    @property
    def version(self) -> int: ...
    @property
    def path(self) -> str: ...
    @property
    def dim(self) -> int: ...
    @property
    def dtype(self) -> str: ...
    @property
    def step(self) -> int: ...
    def __len__(self) -> int: ...
    def lookup(
        self,
        keys: Any,
        missing: str = "init",
        default_row: npt.NDArray[np.float32] | None = None,
        with_found: bool = False,
    ) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.bool_] | None]: ...
    def contains(self, keys: npt.NDArray[np.int64]) -> npt.NDArray[np.bool_]: ...
    def export(self) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float32]]: ...
    def lookup_latency(self) -> tuple[list[float], list[int], float]: ...
    def stats(self) -> dict[str, Any]: ...

def staging_bytes(n: int, dim: int) -> int: ...
def int8_stochastic_steps() -> bool: ...

@final
class SlotMap:
    def __new__(cls, rows: int, policy: str = "lfu") -> SlotMap: ...
    @property
    def capacity(self) -> int: ...
    def __len__(self) -> int: ...
    def nbytes(self) -> int: ...
    def find(
        self, keys: Any, tick: int
    ) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int64], npt.NDArray[np.int64]]: ...
    def admit(
        self, keys: Any, tick: int, protect_from: int
    ) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int64]]: ...
    def serve(
        self,
        keys: Any,
        tick: int,
        table: MappedTable,
        missing: str = "init",
        default_row: npt.NDArray[np.float32] | None = None,
        admit: bool = True,
    ) -> tuple[
        npt.NDArray[np.int32],
        npt.NDArray[np.int64],
        npt.NDArray[np.int64],
        npt.NDArray[np.float32],
        npt.NDArray[np.bool_],
        npt.NDArray[np.int32],
        npt.NDArray[np.int32],
    ]: ...
    def serve_into(
        self,
        keys: Any,
        tick: int,
        table: MappedTable,
        staging: npt.NDArray[np.uint8],
        missing: str = "init",
        default_row: npt.NDArray[np.float32] | None = None,
        with_found: bool = False,
    ) -> tuple[int, int, int, int, int, int, int]: ...
    def remove(self, keys: Any) -> npt.NDArray[np.int32]: ...
    def items(self) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]: ...

@final
class Table:
    def __new__(cls, config: str, simd: str | None = None) -> Table: ...
    @property
    def dtype(self) -> str: ...
    @property
    def clock(self) -> int: ...
    def config_json(self) -> str: ...
    def prefetch(self, keys: Any) -> None: ...
    def evict(
        self, with_rows: bool = False
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float32] | None]: ...
    def admission_counts(self, keys: npt.NDArray[np.int64]) -> npt.NDArray[np.uint32]: ...
    @property
    def dim(self) -> int: ...
    @property
    def state_len(self) -> int: ...
    @property
    def seed(self) -> int: ...
    @property
    def step(self) -> int: ...
    @property
    def num_shards(self) -> int: ...
    @property
    def simd(self) -> str: ...
    @property
    def state_names(self) -> list[str]: ...
    def __len__(self) -> int: ...
    def lookup(
        self,
        keys: Any,
        insert: bool = True,
        missing: str = "init",
        default_row: npt.NDArray[np.float32] | None = None,
    ) -> npt.NDArray[np.float32]: ...
    def lookup_found(
        self,
        keys: Any,
        missing: str = "init",
        default_row: npt.NDArray[np.float32] | None = None,
    ) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.bool_]]: ...
    def lookup_pooled(
        self,
        ids: Any,
        offsets: Any,
        weights: npt.NDArray[np.float32] | None = None,
        combiner: str = "sum",
        insert: bool = True,
        missing: str = "init",
        default_row: npt.NDArray[np.float32] | None = None,
    ) -> npt.NDArray[np.float32]: ...
    def apply_pooled_gradients(
        self,
        ids: Any,
        offsets: Any,
        grads: Any,
        weights: npt.NDArray[np.float32] | None = None,
        combiner: str = "sum",
    ) -> None: ...
    def contains(self, keys: npt.NDArray[np.int64]) -> npt.NDArray[np.bool_]: ...
    def assign(
        self,
        keys: Any,
        values: Any,
        state: npt.NDArray[np.float32] | None = None,
    ) -> None: ...
    def lookup_with_state(
        self,
        keys: npt.NDArray[np.int64],
        insert: bool,
        out: npt.NDArray[np.float32] | None = None,
        stored: bool = False,
    ) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]] | None: ...
    def weight_words(self) -> int: ...
    def assign_stored(
        self,
        keys: npt.NDArray[np.int64],
        words: npt.NDArray[np.float32],
        state: npt.NDArray[np.float32],
    ) -> None: ...
    def set_step(self, step: int) -> None: ...
    def advance_step(self) -> int: ...
    def apply_gradients_at(self, keys: Any, grads: Any, step: int) -> None: ...
    def reserve(self, rows: int) -> None: ...
    def remove(self, keys: npt.NDArray[np.int64]) -> int: ...
    def apply_gradients(self, keys: Any, grads: Any) -> None: ...
    def export(
        self,
        with_state: bool = False,
        with_meta: bool = False,
        consistent: bool = True,
        progress: Progress | None = None,
    ) -> tuple[
        npt.NDArray[np.int64],
        npt.NDArray[np.float32],
        npt.NDArray[np.float32],
        npt.NDArray[np.uint32],
        int,
    ]: ...
    def restore(
        self,
        keys: npt.NDArray[np.int64],
        values: npt.NDArray[np.float32],
        state: npt.NDArray[np.float32] | None,
        meta: npt.NDArray[np.uint32],
        clock: int,
    ) -> None: ...
    def restore_stored(
        self,
        keys: npt.NDArray[np.int64],
        words: npt.NDArray[np.float32],
        state: npt.NDArray[np.float32] | None,
        meta: npt.NDArray[np.uint32],
        clock: int,
    ) -> None: ...
    def lookup_latency(self) -> tuple[list[float], list[int], float]: ...
    def stats(self) -> dict[str, Any]: ...
    def save(
        self,
        path: str,
        incremental: bool = False,
        with_optimizer: bool = True,
        progress: Progress | None = None,
    ) -> tuple[str, int]: ...
    def write_files(self, path: str, prefix: str, with_optimizer: bool = True) -> str: ...
    def publish_parts(
        self,
        path: str,
        id: str,
        parts: list[str],
        rows: int,
        with_optimizer: bool = True,
        partition: str | None = None,
    ) -> str: ...

@final
class Progress:
    def __new__(cls) -> Progress: ...
    @property
    def done(self) -> int: ...

class EmbstoreError(Exception): ...
class CheckpointError(EmbstoreError): ...

def load_table(
    path: str,
    num_shards: int | None = None,
    progress: Progress | None = None,
    disk: str | None = None,
    memory_bytes: int | None = None,
) -> Table: ...
def checkpoint_report(path: str) -> tuple[str, str, bool]: ...
def simd_backends() -> list[str]: ...
def vocabulary() -> dict[str, Any]: ...
def optimizer_constants(name: str, params: dict[str, float], t: int) -> dict[str, float]: ...
def num_threads() -> int: ...
def free_output_buffers() -> int: ...
def output_buffer_stats() -> tuple[int, int, int, int]: ...
def checkpoint_size(path: str) -> tuple[int, int]: ...
def remove_unpublished(path: str, prefix: str) -> None: ...
def check_optimizer(name: str, params: dict[str, float]) -> None: ...
def check_initializer(name: str, params: dict[str, float]) -> None: ...
def check_admission(name: str, params: dict[str, float]) -> None: ...
def lru_stack_distances(keys: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]: ...
def hash_objects(values: list[Any], salt: int) -> npt.NDArray[np.int64]: ...
def hash_fixed_bytes(
    data: npt.NDArray[np.uint8], width: int, salt: int
) -> npt.NDArray[np.int64]: ...
def hash_ucs4(data: npt.NDArray[np.uint32], width: int, salt: int) -> npt.NDArray[np.int64]: ...
def collection_lookup_pooled(
    tables: list[Table],
    ids: list[npt.NDArray[np.int64]],
    offsets: list[npt.NDArray[np.int64]],
    weights: list[npt.NDArray[np.float32] | None],
    combiners: list[str],
    insert: bool = True,
    names: list[str] | None = None,
    missing: str = "init",
) -> npt.NDArray[np.float32]: ...
def collection_apply_pooled_gradients(
    tables: list[Table],
    ids: list[npt.NDArray[np.int64]],
    offsets: list[npt.NDArray[np.int64]],
    weights: list[npt.NDArray[np.float32] | None],
    combiners: list[str],
    grads: npt.NDArray[np.float32],
    names: list[str] | None = None,
) -> None: ...
def partition_owners(
    keys: npt.NDArray[np.int64], size: int, kind: str = "hash", key_space: int | None = None
) -> npt.NDArray[np.int32]: ...
def unique_inverse(
    keys: npt.NDArray[np.int64],
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]: ...
def plan_exchange(
    keys: npt.NDArray[np.int64], size: int, kind: str = "hash", key_space: int | None = None
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]]: ...
def pool_rows(
    rows: npt.NDArray[np.float32],
    idx: npt.NDArray[np.int64],
    offsets: npt.NDArray[np.int64],
    weights: npt.NDArray[np.float32] | None = None,
    combiner: str = "sum",
) -> npt.NDArray[np.float32]: ...
def pool_rows_into(
    rows: npt.NDArray[np.float32],
    idx: npt.NDArray[np.int64],
    offsets: npt.NDArray[np.int64],
    out: npt.NDArray[np.float32],
    col: int,
    weights: npt.NDArray[np.float32] | None = None,
    combiner: str = "sum",
) -> None: ...
def spread_pooled_add(
    grads: npt.NDArray[np.float32],
    col: int,
    idx: npt.NDArray[np.int64],
    offsets: npt.NDArray[np.int64],
    out: npt.NDArray[np.float32],
    weights: npt.NDArray[np.float32] | None = None,
    combiner: str = "sum",
) -> None: ...
def spread_pooled(
    grads: npt.NDArray[np.float32],
    idx: npt.NDArray[np.int64],
    offsets: npt.NDArray[np.int64],
    n: int,
    weights: npt.NDArray[np.float32] | None = None,
    combiner: str = "sum",
) -> npt.NDArray[np.float32]: ...
def bag_coefficients(
    ids: npt.NDArray[np.int64],
    offsets: npt.NDArray[np.int64],
    weights: npt.NDArray[np.float32] | None,
    combiner: str,
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float32]]: ...
def check_bags(
    ids: npt.NDArray[np.int64],
    offsets: npt.NDArray[np.int64],
    weights: npt.NDArray[np.float32] | None = None,
    combiner: str = "sum",
) -> int: ...
def new_checkpoint_id() -> str: ...
def load_table_owned(
    path: str,
    size: int,
    rank: int,
    kind: str = "hash",
    key_space: int | None = None,
    num_shards: int | None = None,
    progress: Progress | None = None,
    manifest: str | None = None,
    disk: str | None = None,
    memory_bytes: int | None = None,
    buckets: list[int] | None = None,
) -> Table: ...
def checkpoint_manifest_text(path: str) -> str: ...

@final
class DirectoryHold:
    def release(self) -> None: ...

def hold_directory(path: str) -> DirectoryHold: ...

# A replica's (embstore.serving.Replica) needs of the core.
def manifest_files(source: str, text: bytes) -> list[tuple[str, int, int]]: ...
def crc32c(data: bytes, value: int = 0) -> int: ...
def publish_copied(path: str, text: bytes) -> int: ...
