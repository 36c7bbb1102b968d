"""The model runner: host batches -> padded device arrays -> the compiled step for the bucket."""
