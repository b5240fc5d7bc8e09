"""Converting Caffe models: upgrade old formats, inspect nets, move weights between formats,
export to ONNX. Each module works on files directly; `caffepar convert ...` is a thin CLI over
them."""
