from tests.cluster_fixtures import mesh_cluster, mesh_state_dir  # noqa: F401 (pytest fixtures)
