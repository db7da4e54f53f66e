"""Preset YAML files, shipped as the ``certvllm.configs`` package (see ``certvllm.config``)."""
