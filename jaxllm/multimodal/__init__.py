"""Images in: fetching and decoding the media a request points at (``media.py``).

The request side of vision-language serving; the image preprocessing and the engine's image
inputs live beside it once the model side lands (issue 41).
"""
