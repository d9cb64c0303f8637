"""File input and output: limits on untrusted input, path checks, torch input checks, the streaming zip writer, durable writes, hashing, memory."""
