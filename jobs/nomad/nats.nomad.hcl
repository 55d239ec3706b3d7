# NATS with JetStream for SilentSwarm: the control plane, the relay and the durable state.
# One server by default; `nomad job run -var nats_servers=3 nats.nomad.hcl` runs a 3-node
# cluster (one per client, routes found through Nomad's service discovery).
#
# Durable across replaced allocations and new job versions: the JetStream store (the host
# volume "swarm-nats") and who may connect (the variable nomad/jobs/swarm-nats).
# Driver: `exec` (chroot, as the user "silentswarm"); the package comes in read-only through the
# host volume "silentswarm". Clients without `exec`: -var driver=raw_exec (no volume mounts:
# the task uses the same paths on the host).

variable "datacenters" {
  type    = list(string)
  default = ["dc1"]
}

variable "nats_servers" {
  type    = number
  default = 1
}

variable "driver" {
  type    = string
  default = "exec"
}

variable "user" {
  type    = string
  default = "silentswarm"
}

job "swarm-nats" {
  datacenters = var.datacenters
  type        = "service"

  group "nats" {
    count = var.nats_servers

    constraint {
      operator = "distinct_hosts"
      value    = "true"
    }

    network {
      port "client" {
        static = 4222
      }
      port "cluster" {
        static = 6222
      }
      port "monitor" {
        static = 8222
      }
    }

    # One server at a time (a cluster keeps its quorum); a version whose health check fails
    # to turn healthy within the deadline is rolled back to the last good one.
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
      delay    = "10s"
      mode     = "delay"
    }

    reschedule {
      delay          = "30s"
      delay_function = "exponential"
      max_delay      = "10m"
      unlimited      = true
    }

    # JetStream's store must outlive allocations: client { host_volume "swarm-nats" {
    # path = "/var/lib/swarm-nats" } } on each NATS client, owned by the task's user. It also
    # pins the job to the clients that have it.
    volume "store" {
      type      = "host"
      source    = "swarm-nats"
      read_only = false
    }

    # client { host_volume "silentswarm" { path = "/opt/silentswarm" read_only = true } }
    volume "package" {
      type      = "host"
      source    = "silentswarm"
      read_only = true
    }

    task "nats" {
      driver = var.driver
      user   = var.user

      # Volumes are mounted where the host has them, so the paths are the same under exec
      # (mounted into the chroot) and raw_exec (which mounts nothing and uses the host's).
      dynamic "volume_mount" {
        for_each = var.driver == "raw_exec" ? [] : ["package"]
        content {
          volume      = "package"
          destination = "/opt/silentswarm"
          read_only   = true
        }
      }

      dynamic "volume_mount" {
        for_each = var.driver == "raw_exec" ? [] : ["store"]
        content {
          volume      = "store"
          destination = "/var/lib/swarm-nats"
          read_only   = false
        }
      }

      service {
        name     = "swarm-nats"
        port     = "client"
        provider = "nomad"

        check {
          type     = "http"
          port     = "monitor"
          path     = "/healthz?js-enabled-only=true"
          interval = "10s"
          timeout  = "2s"

          # Three failures in a row restart the task; the grace covers JetStream's recovery
          # of its store at start.
          check_restart {
            limit = 3
            grace = "60s"
          }
        }
      }

      service {
        name     = "swarm-nats-cluster"
        port     = "cluster"
        provider = "nomad"
      }

      # SIGTERM: nats-server flushes JetStream and exits; Nomad's client caps kill_timeout at
      # its max_kill_timeout (30 s by default).
      kill_timeout = "30s"

      config {
        command = "/opt/silentswarm/bin/nats-server"
        args = concat(
          [
            "--addr", "0.0.0.0",
            "--port", "${NOMAD_PORT_client}",
            "--http_port", "${NOMAD_PORT_monitor}",
            "--jetstream",
            "--store_dir", "/var/lib/swarm-nats",
            "--server_name", "swarm-nats-${NOMAD_ALLOC_INDEX}",
          ],
          ["--config", "${NOMAD_TASK_DIR}/${var.nats_servers > 1 ? "cluster" : "auth"}.conf"],
        )
      }

      # Who may connect: the swarm's NATS authority (`swarm nats-auth init` writes it), from
      #   nomad var put nomad/jobs/swarm-nats server_conf=@nats-auth/server.conf
      # The task waits until that variable exists: NATS never runs open by accident. (For a
      # throwaway dev cluster put server_conf="" and run the leader with SWARM_DEV=1.) The
      # account JWTs the leader pushes (revoked users) are kept on the store volume: this
      # resolver replaces the one server.conf names (a directory of the machine it was made on).
      template {
        destination = "local/auth.conf"
        change_mode = "restart"
        data        = <<-EOT
        {{- with nomadVar "nomad/jobs/swarm-nats" }}{{ .server_conf }}
        {{ if .server_conf }}resolver: { type: full, dir: "/var/lib/swarm-nats/jwt", allow_delete: false }{{ end }}{{ end }}
        EOT
      }

      # With more than one server: routes to the others, reloaded (SIGHUP) as they come and
      # go. The task starts with the plain flags above and reads this file on reload.
      dynamic "template" {
        for_each = var.nats_servers > 1 ? [1] : []
        content {
          destination   = "local/cluster.conf"
          change_mode   = "signal"
          change_signal = "SIGHUP"
          data          = <<-EOT
          {{- $routes := "" }}{{ range nomadService "swarm-nats-cluster" }}{{ $routes = printf "%s nats-route://%s:%d" $routes .Address .Port }}{{ end }}
          include "auth.conf"
          cluster {
            name: swarm
            listen: 0.0.0.0:6222
            routes: [{{ $routes }} ]
          }
          EOT
        }
      }

      resources {
        cpu    = 500
        memory = 512
      }
    }
  }
}
