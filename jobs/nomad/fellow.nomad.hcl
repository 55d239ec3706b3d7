# SilentSwarm fellows: a system job, so every eligible client node runs one agent.
# CPU fellows by default; `-var gpus=N` asks for N NVIDIA GPUs per node (the nvidia device
# plugin), and the agent maps the devices Nomad assigns (NVIDIA_VISIBLE_DEVICES) to
# CUDA_VISIBLE_DEVICES, which TensorFlow honours outside containers.
# Each fellow gets its own NATS user from the leader at start (fleet enrollment): the variable
# nomad/jobs/swarm-fellow holds the enrollment token, and optional caps, e.g.
#   nomad var put nomad/jobs/swarm-fellow enroll_token=<the leader's> max_vram_gb=24
# Its user and checkpoints live in the allocation (SWARM_STATE_DIR/nats.creds); the sticky
# ephemeral disk carries them over to the node's next allocation (a new job version).
#
# Driver: `exec` (chroot, as the user "silentswarm"); the package comes in read-only through the
# host volume "silentswarm". The nvidia device plugin gives a task only NVIDIA_VISIBLE_DEVICES,
# no device nodes, so with gpus > 0 the task runs under raw_exec (still as "silentswarm", which
# the package puts in the video and render groups); -var driver=... overrides either choice.

variable "datacenters" {
  type    = list(string)
  default = ["dc1"]
}

variable "gpus" {
  type    = number
  default = 0
}

# "" picks exec without GPUs, raw_exec with them.
variable "driver" {
  type    = string
  default = ""
}

variable "user" {
  type    = string
  default = "silentswarm"
}

locals {
  driver = var.driver != "" ? var.driver : (var.gpus > 0 ? "raw_exec" : "exec")
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
      # The port it binds for its replicas' ring (jobs with replicas).
      port "sync" {}
    }

    # A system job counts every exit against these attempts, and a fellow exits on purpose
    # (SWARM_FELLOW_EXIT_AFTER_TRAINING=1, updates): keep it coming back. (System jobs take
    # no reschedule block: they run on every eligible node.)
    restart {
      attempts = 1000
      interval = "1h"
      delay    = "5s"
      mode     = "delay"
    }

    # A new version replaces one node's fellow at a time, 30 s apart. Fellows register no
    # service: healthy means running for 10 s. Older Nomad versions enforce only max_parallel
    # and stagger for system jobs.
    update {
      max_parallel      = 1
      stagger           = "30s"
      health_check      = "task_states"
      min_healthy_time  = "10s"
      healthy_deadline  = "5m"
      progress_deadline = "10m"
      auto_revert       = false
    }

    # The allocation's data (the fellow's NATS user, checkpoints) moves to the node's next
    # allocation: a new job version keeps the fellow's name and user.
    ephemeral_disk {
      sticky = true
    }

    # client { host_volume "silentswarm" { path = "/opt/silentswarm" read_only = true } }
    volume "package" {
      type      = "host"
      source    = "silentswarm"
      read_only = true
    }

    task "agent" {
      driver = local.driver
      user   = var.user

      dynamic "volume_mount" {
        for_each = local.driver == "raw_exec" ? [] : ["package"]
        content {
          volume      = "package"
          destination = "/opt/silentswarm"
          read_only   = true
        }
      }

      # SIGTERM: the agent stops its stage runtime (SIGKILL after 5 s) and deregisters.
      kill_timeout = "30s"

      config {
        command = "/opt/silentswarm/bin/swarm-agent"
        args    = ["--name", "${node.unique.name}"]
      }

      env {
        SWARM_DATA_ADDRESS = "tcp://${NOMAD_IP_data}:${NOMAD_PORT_data}"
        SWARM_SYNC_ADDRESS = "tcp://${NOMAD_IP_sync}:${NOMAD_PORT_sync}"
        SWARM_STATE_DIR    = "${NOMAD_ALLOC_DIR}/data"
        SWARM_LOG_LEVEL    = "INFO"
        HOME               = "${NOMAD_ALLOC_DIR}/data"
      }

      template {
        destination = "secrets/fellow.env"
        env         = true
        change_mode = "restart"
        perms       = "0600"
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

      resources {
        cpu    = 2000
        memory = var.gpus > 0 ? 8192 : 4096

        dynamic "device" {
          for_each = var.gpus > 0 ? ["nvidia/gpu"] : []
          labels   = ["nvidia/gpu"]
          content {
            count = var.gpus
          }
        }
      }
    }
  }
}
