//! Making a backend (the device, its context, its stream, the chunk kinds
//! it creates) and its own chunk creation, outside the `Backend` trait.

use super::*;

impl CudaBackend {
    /// A backend on GPU `ordinal`'s primary context.
    ///
    /// Errors: [`Error::DriverUnavailable`] without a loadable driver or when
    /// it fails to initialise, [`Error::InvalidDevice`] for an ordinal the
    /// machine lacks, [`Error::VmmUnsupported`] where the device has no VMM.
    pub fn new(ordinal: u32) -> Result<Arc<Self>> {
        Self::with_desc(ordinal, &CudaBackendDesc::default())
    }

    /// A backend on GPU `ordinal`'s primary context whose chunks are made as
    /// `desc` says (see [`CudaBackendDesc::nccl_ready`]). Errors as
    /// [`new`](Self::new).
    pub fn with_desc(ordinal: u32, desc: &CudaBackendDesc) -> Result<Arc<Self>> {
        Self::check_driver()?;
        let unavailable = |e: Error| Error::DriverUnavailable {
            reason: e.to_string(),
        };
        driver::init().map_err(unavailable)?;
        let count = driver::device_count().map_err(unavailable)?;
        if ordinal >= count {
            return Err(Error::InvalidDevice {
                device: ordinal,
                count,
            });
        }
        Self::from_context_with(driver::context(ordinal).map_err(unavailable)?, desc)
    }

    /// A backend on an existing cudarc context (its device is the home).
    pub fn from_context(ctx: Arc<CudaContext>) -> Result<Arc<Self>> {
        Self::from_context_with(ctx, &CudaBackendDesc::default())
    }

    /// [`from_context`](Self::from_context), with chunks made as `desc`
    /// says.
    pub fn from_context_with(ctx: Arc<CudaContext>, desc: &CudaBackendDesc) -> Result<Arc<Self>> {
        let device = ctx.ordinal() as u32;
        let attr = |a| driver::context_attribute(&ctx, a);
        use sys::CUdevice_attribute as A;
        if attr(A::CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED)? == 0 {
            return Err(Error::VmmUnsupported { device });
        }
        let host_numa =
            if attr(A::CU_DEVICE_ATTRIBUTE_HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED)? != 0 {
                Some(attr(A::CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID)?.max(0))
            } else {
                None
            };
        let device_count = driver::device_count()?;
        let nccl = if desc.nccl_ready {
            let fabric =
                attr(A::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED).unwrap_or(0) != 0;
            let rdma = attr(A::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED)
                .unwrap_or(0)
                != 0;
            let home = driver::device_get(device)?;
            let mut peers = Vec::new();
            for p in (0..device_count).filter(|&p| p != device) {
                // SAFETY: both handles come from cuDeviceGet.
                if unsafe { driver::can_access_peer(driver::device_get(p)?, home) }? {
                    peers.push(p);
                }
            }
            Some(NcclChunks {
                handle_types: std::sync::atomic::AtomicU32::new(
                    driver::HANDLE_POSIX_FD | if fabric { driver::HANDLE_FABRIC } else { 0 },
                ),
                rdma,
                peers,
                no_fabric: Mutex::new((!fabric).then(|| {
                    "the device does not support them (CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED is 0)"
                        .to_owned()
                })),
            })
        } else {
            None
        };
        let this = Self {
            stream: driver::new_stream(&ctx)?,
            ctx,
            device,
            nccl,
            device_count,
            granularity: Mutex::default(),
            spare_events: Arc::default(),
            host_numa,
            counters: Arc::default(),
            pool_slot: Default::default(),
        };
        this.granularity(Location::Device(device))?;
        Ok(Arc::new(this))
    }

    /// Returns `Ok` if the CUDA driver library can be loaded here.
    pub fn check_driver() -> Result<()> {
        if driver::driver_present() {
            Ok(())
        } else {
            Err(Error::DriverUnavailable {
                reason: "the CUDA driver library (libcuda) could not be loaded".into(),
            })
        }
    }

    /// The cudarc context this backend works in.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The home device's ordinal.
    pub fn device(&self) -> u32 {
        self.device
    }

    /// What this backend's device chunks are like: made for NCCL or not,
    /// their handle types, RDMA flag, peers and granularity.
    pub fn chunk_kind(&self) -> Result<ChunkKind> {
        let granularity = self.granularity(self.home())?;
        Ok(match &self.nccl {
            Some(n) => {
                let types = n.handle_types.load(std::sync::atomic::Ordering::Relaxed);
                ChunkKind {
                    nccl_ready: true,
                    posix_fd: true,
                    fabric: types & driver::HANDLE_FABRIC != 0,
                    no_fabric: n.no_fabric.lock().clone(),
                    gpu_direct_rdma: n.rdma,
                    peers: n.peers.clone(),
                    granularity,
                }
            }
            None => ChunkKind {
                nccl_ready: false,
                posix_fd: false,
                fabric: false,
                no_fabric: Some(
                    "chunks are not made NCCL-ready (CudaBackendDesc::nccl_ready)".into(),
                ),
                gpu_direct_rdma: false,
                peers: Vec::new(),
                granularity,
            },
        })
    }

    /// The NCCL settings that apply to chunks at `placement`: device chunks
    /// of an NCCL-ready backend.
    pub(super) fn nccl_for(&self, placement: Location) -> Option<&NcclChunks> {
        self.nccl.as_ref().filter(|_| placement != Location::Host)
    }

    /// The properties chunks at `location` (`placement`) are made with
    /// (apart from a shareable chunk's handle type): what their granularity
    /// is asked with.
    pub(super) fn chunk_prop(
        &self,
        placement: Location,
        location: sys::CUmemLocation,
    ) -> sys::CUmemAllocationProp {
        match self.nccl_for(placement) {
            Some(n) => driver::nccl_prop(
                location,
                n.handle_types.load(std::sync::atomic::Ordering::Relaxed),
                n.rdma,
            ),
            None => driver::allocation_prop(location),
        }
    }

    /// Creates a device chunk as `ncclMemAlloc` does: POSIX_FD (and FABRIC
    /// until the driver refuses it), RDMA capable where supported. With
    /// whether it has the fabric handle type.
    pub(super) fn create_nccl(
        &self,
        n: &NcclChunks,
        bytes: usize,
        location: sys::CUmemLocation,
    ) -> Result<(sys::CUmemGenericAllocationHandle, bool)> {
        use std::sync::atomic::Ordering::Relaxed;
        let types = n.handle_types.load(Relaxed);
        let fabric = types & driver::HANDLE_FABRIC != 0;
        match driver::mem_create(bytes, &driver::nccl_prop(location, types, n.rdma)) {
            Err(Error::Driver { source, .. })
                if fabric
                    && matches!(
                        source.0,
                        sys::CUresult::CUDA_ERROR_NOT_PERMITTED
                            | sys::CUresult::CUDA_ERROR_NOT_SUPPORTED
                    ) =>
            {
                // No IMEX channel (or no fabric here): POSIX_FD alone from
                // now on, as NCCL falls back.
                tracing::info!(error = %source, "vmmbuf: fabric handles refused; POSIX_FD only");
                *n.no_fabric.lock() = Some(format!("the driver refused them: {source}"));
                n.handle_types.store(driver::HANDLE_POSIX_FD, Relaxed);
                driver::mem_create(
                    bytes,
                    &driver::nccl_prop(location, driver::HANDLE_POSIX_FD, n.rdma),
                )
                .map(|h| (h, false))
            }
            r => r.map(|h| (h, fabric)),
        }
    }

    /// `(free, total)` bytes of the home device, from `cuMemGetInfo`.
    pub fn mem_info(&self) -> Result<(usize, usize)> {
        driver::bind(&self.ctx)?;
        driver::mem_info()
    }

    /// A fence after all work submitted to `stream` so far: an event recorded
    /// on it. Give it to
    /// [`GrowableBuffer::shrink_to_fit_after`](crate::GrowableBuffer::shrink_to_fit_after)
    /// once the last work that uses the bytes being given back is on `stream`.
    pub fn fence(&self, stream: &CudaStream) -> Result<CudaFence> {
        // A recycled event of this context if there is one: creating and
        // destroying an event per fence costs more than the fence.
        // Spares carry their context's handle: matching one reads no
        // event's context (a miss with cold caches). The latest returned
        // is tried first: its memory is the likeliest still cached.
        let key = stream_key(stream);
        let spare = {
            let mut spares = self.spare_events.lock();
            let at = spares.iter().rposition(|(ctx, _)| *ctx == key.0);
            at.map(|i| spares.swap_remove(i).1)
        };
        let event = match spare {
            Some(e) => {
                driver::event_record(&e, stream)?;
                e
            }
            None => driver::record_event(stream)?,
        };
        Ok(CudaFence {
            event: Some(event),
            key,
            spares: Arc::downgrade(&self.spare_events),
        })
    }

    pub(super) fn check_location(&self, l: Location) -> Result<()> {
        match l {
            Location::Device(d) if d >= self.device_count => Err(Error::InvalidDevice {
                device: d,
                count: self.device_count,
            }),
            _ => Ok(()),
        }
    }

    /// The `CUmemLocation` of a placement.
    pub(super) fn placement(&self, l: Location) -> Result<sys::CUmemLocation> {
        self.check_location(l)?;
        use sys::CUmemLocationType as T;
        Ok(match l {
            Location::Device(d) => driver::location(T::CU_MEM_LOCATION_TYPE_DEVICE, d as i32),
            Location::Host => match self.host_numa {
                Some(node) => driver::location(T::CU_MEM_LOCATION_TYPE_HOST_NUMA, node),
                None => {
                    return Err(Error::Unsupported {
                        what: format!(
                            "host placement: gpu{} has no host-NUMA VMM support",
                            self.device
                        ),
                    })
                }
            },
        })
    }

    /// The granularity for `placement` with `flag`, asked of the driver with
    /// the properties this backend's chunks there are made with.
    pub(crate) fn query_granularity(
        &self,
        placement: Location,
        flag: sys::CUmemAllocationGranularity_flags,
    ) -> Result<usize> {
        let prop = self.chunk_prop(placement, self.placement(placement)?);
        driver::bind(&self.ctx)?;
        let g = driver::allocation_granularity(&prop, flag)?;
        if !g.is_power_of_two() {
            return Err(Error::Unsupported {
                what: format!("granularity {g} is not a power of two"),
            });
        }
        Ok(g)
    }

    /// The CUDA location an access descriptor names.
    pub(super) fn access_location(&self, l: Location) -> Result<sys::CUmemLocation> {
        self.check_location(l)?;
        use sys::CUmemLocationType as T;
        Ok(match l {
            Location::Device(id) => driver::location(T::CU_MEM_LOCATION_TYPE_DEVICE, id as i32),
            // HOST_NUMA, whose id the driver ignores for access, is what it
            // takes for host-NUMA allocations (the only host chunks we make).
            Location::Host => driver::location(
                T::CU_MEM_LOCATION_TYPE_HOST_NUMA,
                self.host_numa.unwrap_or(0),
            ),
        })
    }
}

impl CudaBackend {
    pub(super) fn create_with(
        &self,
        bytes: usize,
        placement: Location,
        shareable: bool,
    ) -> Result<CudaChunk> {
        let granularity = self.granularity(placement)?;
        crate::backend::check_chunk(bytes, granularity)?;
        let location = self.placement(placement)?;
        driver::bind(&self.ctx)?;
        let nccl = self.nccl_for(placement);
        let (handle, fabric) = match nccl {
            Some(n) => self.create_nccl(n, bytes, location)?,
            None if shareable => (
                driver::mem_create(bytes, &driver::shareable_prop(location))?,
                false,
            ),
            None => (
                driver::mem_create(bytes, &driver::allocation_prop(location))?,
                false,
            ),
        };
        self.counters.update(|c| {
            c.chunks += 1;
            c.chunk_bytes += bytes;
        });
        Ok(CudaChunk {
            handle,
            id: crate::backend::next_chunk_id(),
            bytes,
            placement,
            shareable,
            exportable: shareable || nccl.is_some(),
            fabric,
            released: false,
            ctx: self.ctx.clone(),
            counters: self.counters.clone(),
        })
    }
}
