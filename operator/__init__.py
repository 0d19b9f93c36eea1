"""The Kubernetes operator: reconciles KVPool and PDDeployment into workloads."""
