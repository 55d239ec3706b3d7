# SilentSwarm fellows: a system job, so every eligible client node runs one agent.
# CPU fellows by default; `-var gpu=true` asks for an NVIDIA GPU per node (the nvidia device
# plugin), and the agent maps the devices Nomad assigns (NVIDIA_VISIBLE_DEVICES) to
# CUDA_VISIBLE_DEVICES, which TensorFlow honours outside containers.
# Each fellow gets its own NATS user from the leader at start (fleet enrollment): the variable
# nomad/jobs/swarm-fellow holds the enrollment token, and optional caps, e.g.
#   nomad var put nomad/jobs/swarm-fellow enroll_token=<the leader's> max_vram_gb=24
# The user is kept in the allocation (SWARM_STATE_DIR/nats.creds).
# Checkpoints live in the allocation (SWARM_STATE_DIR); a replaced allocation starts afresh.

variable "datacenters" {
  type    = list(string)
  default = ["dc1"]
}

variable "gpu" {
  type    = bool
  default = false
}

variable "node_class" {
  type    = string
  default = ""
}

job "swarm-fellow" {
  datacenters = var.datacenters
  type        = "system"

  group "fellow" {
    dynamic "constraint" {
      for_each = var.node_class == "" ? [] : [var.node_class]
      content {
        attribute = "${node.class}"
        value     = constraint.value
      }
    }

    network {
      # The port this fellow's stage binds for tensors from its upstream peer.
      port "data" {}
    }

    # A system job counts every exit against these attempts, and a fellow exits on purpose
    # (SWARM_FELLOW_EXIT_AFTER_TRAINING=1, updates): keep it coming back.
    restart {
      attempts = 1000
      interval = "1h"
      delay    = "5s"
      mode     = "delay"
    }

    task "agent" {
      driver = "raw_exec"

      config {
        command = "/opt/silentswarm/bin/swarm-agent"
        args    = ["--name", "${node.unique.name}"]
      }

      env {
        SWARM_DATA_ADDRESS = "tcp://${NOMAD_IP_data}:${NOMAD_PORT_data}"
        SWARM_STATE_DIR    = "${NOMAD_ALLOC_DIR}/data"
        SWARM_LOG_LEVEL    = "INFO"
      }

      template {
        destination = "secrets/fellow.env"
        env         = true
        change_mode = "restart"
        data        = <<-EOT
        {{- range nomadService "swarm-nats" }}
        SWARM_NATS_URL=nats://{{ .Address }}:{{ .Port }}
        {{- else }}
        SWARM_NATS_URL=nats://swarm-nats-not-registered.invalid:4222
        {{- end }}
        {{- range nomadService "swarm-leader" }}
        SWARM_LEADER_URL=http://{{ .Address }}:{{ .Port }}
        {{- else }}
        SWARM_LEADER_URL=http://swarm-leader-not-registered.invalid:8080
        {{- end }}
        {{- if nomadVarExists "nomad/jobs/swarm-fellow" }}
        {{- with nomadVar "nomad/jobs/swarm-fellow" }}
        {{- if .max_vram_gb }}
        SWARM_FELLOW_MAX_VRAM_GB={{ .max_vram_gb }}
        {{- end }}
        {{- if .max_memory_gb }}
        SWARM_FELLOW_MAX_MEMORY_GB={{ .max_memory_gb }}
        {{- end }}
        {{- if .enroll_token }}
        SWARM_ENROLL_TOKEN={{ .enroll_token }}
        {{- end }}
        {{- end }}
        {{- end }}
        EOT
      }

      dynamic "resources" {
        for_each = var.gpu ? [] : [1]
        content {
          cpu    = 2000
          memory = 4096
        }
      }

      dynamic "resources" {
        for_each = var.gpu ? [1] : []
        content {
          cpu    = 2000
          memory = 8192

          device "nvidia/gpu" {
            count = 1
          }
        }
      }
    }
  }
}
