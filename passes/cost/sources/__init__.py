"""The file readers behind the cost model's profiles: Sailor and Zorse data folders, the device
catalog and `hetc profile` files (passes/cost/profiles.py merges what they read)."""

__all__: list[str] = []
