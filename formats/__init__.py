"""The on-disk contract of kimi-stream: the weight file (spec, reader, writer), the codecs that
define how a tensor's values are laid out as bytes, the model config schema, tensor naming, and
readers for the source formats we convert from (safetensors). Both convert and runtime import
this package; it imports neither."""
