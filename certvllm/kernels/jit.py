"""Build-once loading of certvllm's C++ extensions (torch's C++ extension tools).

Each extension compiles into ``$CERTVLLM_EXT_DIR/<name>-<digest>`` (default ``~/.cache/certvllm/extensions``)
on first use; a failure is remembered and reported once, and callers fall back to a slower path. The digest
covers the sources' bytes, the build arguments and the torch build, so two checkouts or versions never rebuild
one folder under each other (a build that changed a running server's module in place, or loaded one with another
interface, was seen with a test run and a server from two trees).

A folder whose build finished holds ``<module>.so`` and a ``built`` marker (written after the module imported);
later processes import that library directly instead of asking torch's ninja build, which compares file times and
rebuilt everything (about a minute for the CUDA attend kernel) whenever the sources were copied anew with the
same bytes, as on every run on the lent GPU machines.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import logging
import threading
from importlib import resources
from pathlib import Path
from types import ModuleType

from certvllm.env import environment

logger = logging.getLogger("certvllm")
BUILT_MARKER = "built"
"""Written into a build folder once its module imported: the folder's library is complete."""
STALE_LOCK_SECONDS = 600.0
"""Age past which a build folder's ``lock`` is taken to be left by a killed build (one takes well under a minute):
torch's loader would otherwise wait on it forever."""


def extensions_root() -> Path:
    return environment().ext_dir


def csrc_file(*parts: str) -> Path:
    """A source file of the ``certvllm.csrc`` package (``csrc/`` in the repository)."""
    return Path(str(resources.files("certvllm.csrc").joinpath(*parts)))


class JitExtension:
    """One extension module, compiled on first :meth:`load` and cached per process."""

    def __init__(
        self, name: str, sources: list[Path], fallback: str, headers: tuple[Path, ...] = (), **build_args: object
    ) -> None:
        """``sources`` are compiled (in parallel where torch's ninja build can); ``headers`` are files they include,
        which the build folder's digest covers too."""
        self.name, self.sources, self.fallback = name, sources, fallback
        # lists frozen to tuples: torch's loader appends to the flag lists it is given, which would change the
        # digest (and the folder) of a built extension under its own feet
        self.build_args = {k: tuple(v) if isinstance(v, list) else v for k, v in build_args.items()}
        self.headers = headers
        self._lock = threading.Lock()
        self._module: ModuleType | None = None
        self._failed: str | None = None

    @property
    def module_name(self) -> str:
        return self.name.split("-")[0]

    @property
    def digest(self) -> str:
        """12 hex digits of the sources' and headers' bytes, the build arguments and the torch build (its version
        and CUDA version: the library links against both)."""
        import torch

        h = hashlib.sha256(repr(sorted(self.build_args.items())).encode())
        h.update(f"{torch.__version__}|{torch.version.cuda}".encode())
        for source in (*self.sources, *self.headers):
            h.update(Path(source).read_bytes())
        return h.hexdigest()[:12]

    @property
    def build_dir(self) -> Path:
        path = extensions_root() / f"{self.name}-{self.digest}"
        path.mkdir(parents=True, exist_ok=True)
        return path

    @property
    def loaded(self) -> ModuleType | None:
        return self._module

    @property
    def failed(self) -> bool:
        return self._failed is not None

    def load(self) -> ModuleType:
        """Build (once) and import; raises RuntimeError naming the reason when it cannot."""
        if self._module is not None:
            return self._module
        with self._lock:
            if self._module is not None:
                return self._module
            if self._failed is not None:
                raise RuntimeError(self._failed)
            self._module = self._import_built()
            if self._module is not None:
                return self._module
            from torch.utils.cpp_extension import load as load_extension

            clear_stale_lock(self.build_dir)
            try:
                self._module = load_extension(name=self.module_name, sources=[str(s) for s in self.sources],
                                              build_directory=str(self.build_dir), verbose=False,
                                              **self._fresh_build_args())  # type: ignore[arg-type]  # fmt: skip
            except Exception as err:  # a missing compiler must not take the service down
                self._failed = f"{self.name} unavailable ({type(err).__name__}: {err}); {self.fallback}"
                logger.warning("%s", self._failed)
                raise RuntimeError(self._failed) from err
            (self.build_dir / BUILT_MARKER).touch()
        return self._module

    def _fresh_build_args(self) -> dict[str, object]:
        """The build arguments with new lists, for a loader that may change them."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in self.build_args.items()}

    def _import_built(self) -> ModuleType | None:
        """The library of a finished build of this digest, imported without a build step; None when there is none
        (no marker: never built, or a build that did not finish) or it does not import (then it is rebuilt)."""
        library = self.build_dir / f"{self.module_name}.so"
        if not (self.build_dir / BUILT_MARKER).exists() or not library.exists():
            return None
        try:
            import torch  # noqa: F401  (the library resolves torch's symbols from the loaded torch)

            spec = importlib.util.spec_from_file_location(self.module_name, library)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        except Exception as err:  # a damaged library: build again, as before the marker existed
            logger.warning("certvllm: %s did not import (%s: %s); rebuilding it", library, type(err).__name__, err)
            # a read-only prebuilt folder (an image's) keeps its marker: the build that follows reports what fails
            with contextlib.suppress(OSError):
                (self.build_dir / BUILT_MARKER).unlink(missing_ok=True)
            return None
        return module


def clear_stale_lock(build_dir: Path, max_age: float = STALE_LOCK_SECONDS) -> bool:
    """Remove ``build_dir/lock`` if it is older than ``max_age`` seconds (a build killed while it held the lock, e.g.
    a stopped server or test run); returns whether one was removed. A live build touches no lock for that long."""
    import time

    lock = build_dir / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return False
    if age < max_age:
        return False
    lock.unlink(missing_ok=True)
    logger.warning("certvllm: removed %s, %.0f s old: a build of this extension was killed while it held the lock",
                   lock, age)  # fmt: skip
    return True
