# The SilentSwarm leader: REST API, Ops UI (/ops/join-v2), Prometheus metrics, job orchestration.
# It finds NATS through Nomad's service discovery. Until the swarm-nats service is registered it
# gets an address that cannot resolve (and waits), never none (without one it would start a
# private nats-server of its own).
#
# Its state directory (the bootstrap wheel, exports, uploaded datasets, and the operator token
# it generates when the variable holds none) is the host volume "swarm-leader-state", so a
# replaced allocation keeps it; the jobs themselves live in JetStream (the swarm-nats job).
# The NATS authority, the enrollment token and the operator token come from the variable
# nomad/jobs/swarm-leader. See docs/deploy/nomad.md.
#
# Driver: `exec` (chroot, as the user "silentswarm"); the package comes in read-only through the
# host volume "silentswarm". Clients without `exec`: -var driver=raw_exec (no volume mounts:
# the task uses the same paths on the host).

variable "datacenters" {
  type    = list(string)
  default = ["dc1"]
}

variable "leader_port" {
  type    = number
  default = 8080
}

variable "driver" {
  type    = string
  default = "exec"
}

variable "user" {
  type    = string
  default = "silentswarm"
}

job "swarm-leader" {
  datacenters = var.datacenters
  type        = "service"

  group "leader" {
    count = 1

    network {
      port "http" {
        static = var.leader_port
      }
    }

    # One at a time (the state volume has one writer); a version whose /health fails to turn
    # healthy within the deadline is rolled back to the last good one.
    update {
      max_parallel      = 1
      health_check      = "checks"
      min_healthy_time  = "10s"
      healthy_deadline  = "5m"
      progress_deadline = "10m"
      auto_revert       = true
    }

    restart {
      attempts = 10
      interval = "30m"
      delay    = "5s"
      mode     = "delay"
    }

    reschedule {
      delay          = "30s"
      delay_function = "exponential"
      max_delay      = "10m"
      unlimited      = true
    }

    # client { host_volume "swarm-leader-state" { path = "/var/lib/swarm-leader" } },
    # owned by the task's user. It also pins the job to the clients that have it.
    volume "state" {
      type      = "host"
      source    = "swarm-leader-state"
      read_only = false
    }

    # client { host_volume "silentswarm" { path = "/opt/silentswarm" read_only = true } }
    volume "package" {
      type      = "host"
      source    = "silentswarm"
      read_only = true
    }

    task "leader" {
      driver = var.driver
      user   = var.user

      config {
        command = "/opt/silentswarm/bin/swarm-leader"
      }

      # Volumes are mounted where the host has them, so the paths are the same under exec
      # (mounted into the chroot) and raw_exec (which mounts nothing and reads the host's).
      dynamic "volume_mount" {
        for_each = var.driver == "raw_exec" ? [] : ["package"]
        content {
          volume      = "package"
          destination = "/opt/silentswarm"
          read_only   = true
        }
      }

      dynamic "volume_mount" {
        for_each = var.driver == "raw_exec" ? [] : ["state"]
        content {
          volume      = "state"
          destination = "/var/lib/swarm-leader"
          read_only   = false
        }
      }

      service {
        name     = "swarm-leader"
        port     = "http"
        provider = "nomad"
        tags     = ["ops-ui", "prometheus"]

        # Nomad's native services carry no meta to Prometheus: find the leader by the
        # "prometheus" tag (nomad_sd_configs) and scrape metrics_path /api/v1/metrics.

        check {
          type     = "http"
          path     = "/health"
          interval = "10s"
          timeout  = "2s"

          # Three failures in a row (30 s) restart the task (under the restart block above);
          # the grace covers start-up (state loaded from JetStream).
          check_restart {
            limit = 3
            grace = "60s"
          }
        }
      }

      # SIGTERM: the leader stops taking requests and lets running ones finish (5 s).
      kill_timeout = "30s"

      env {
        SWARM_LEADER_HOST   = "0.0.0.0"
        SWARM_LEADER_PORT   = "${NOMAD_PORT_http}"
        SWARM_STATE_DIR     = "/var/lib/swarm-leader"
        SWARM_LOG_LEVEL     = "INFO"
        SWARM_NATS_AUTH_DIR = "${NOMAD_SECRETS_DIR}/nats-auth"
        SWARM_NATS_CREDS    = "${NOMAD_SECRETS_DIR}/nats-auth/leader.creds"
      }

      # The swarm's NATS authority (its keys mint each fellow's user) and the leader's own
      # user, from the variable nomad/jobs/swarm-leader (see docs/deploy/nomad.md):
      #   operator_nk, account_nk, system_nk, leader_creds. The task waits until it exists.
      # Nomad writes templates as its own user (root): 0644 lets the task's user read them;
      # they stay on the task's secrets tmpfs, inside its chroot and Nomad's data_dir.
      template {
        destination = "secrets/nats-auth/operator.nk"
        perms       = "0644"
        data        = <<-EOT
        {{- with nomadVar "nomad/jobs/swarm-leader" }}{{ .operator_nk }}{{ end }}
        EOT
      }

      template {
        destination = "secrets/nats-auth/account.nk"
        perms       = "0644"
        data        = <<-EOT
        {{- with nomadVar "nomad/jobs/swarm-leader" }}{{ .account_nk }}{{ end }}
        EOT
      }

      template {
        destination = "secrets/nats-auth/system.nk"
        perms       = "0644"
        data        = <<-EOT
        {{- with nomadVar "nomad/jobs/swarm-leader" }}{{ .system_nk }}{{ end }}
        EOT
      }

      template {
        destination = "secrets/nats-auth/leader.creds"
        perms       = "0644"
        data        = <<-EOT
        {{- with nomadVar "nomad/jobs/swarm-leader" }}{{ .leader_creds }}{{ end }}
        EOT
      }

      # Into the environment (Nomad reads this file itself: it stays 0600): enroll_token (the
      # secret fleet fellows present to get their user) and operator_token (the API's bearer
      # token, SWARM_API_TOKEN; without it the leader generates one in its state volume).
      template {
        destination = "secrets/leader.env"
        env         = true
        change_mode = "restart"
        perms       = "0600"
        data        = <<-EOT
        {{- with nomadVar "nomad/jobs/swarm-leader" }}
        SWARM_ENROLL_TOKEN={{ .enroll_token }}
        {{- if .operator_token }}
        SWARM_API_TOKEN={{ .operator_token }}
        {{- end }}
        {{- end }}
        EOT
      }

      template {
        destination = "local/nats.env"
        env         = true
        change_mode = "restart"
        data        = <<-EOT
        {{- range nomadService "swarm-nats" }}
        SWARM_NATS_URL=nats://{{ .Address }}:{{ .Port }}
        {{- else }}
        SWARM_NATS_URL=nats://swarm-nats-not-registered.invalid:4222
        {{- end }}
        EOT
      }

      resources {
        cpu    = 500
        memory = 512
      }
    }
  }
}
