"""The client library inference engines call to put and get KV blocks in a pool."""
