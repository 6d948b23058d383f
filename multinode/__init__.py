"""multinode: a real multi-node cluster on one machine (network namespaces, a tbf-shaped link).
See multinode/__main__.py for the commands and tutorials/11_multi_node.md for the walk-through."""
