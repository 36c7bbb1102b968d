"""Images in: fetching and decoding the media a request points at (``media.py``) and the
preprocessing (``image_processor.py``) that turns a decoded image into the pixel array a vision
tower takes, without torch (issue 41)."""
