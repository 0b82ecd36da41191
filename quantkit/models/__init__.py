"""Loading the model to quantize: a Hugging Face folder, hub id or GGUF file (``load``), or a safetensors folder
read one decoder layer at a time when it is larger than host memory (``lazy``)."""
