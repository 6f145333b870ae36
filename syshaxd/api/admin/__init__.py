"""The admin socket (unix_socket: the Unix socket `syshax` talks to) and its client end (client)."""
